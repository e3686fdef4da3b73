"""JSON encode/decode with orjson when it is installed, the stdlib otherwise.

The validator and driver handle millions of lines; orjson is several times
faster than ``json`` and rejects invalid UTF-8 on its own.
"""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson

    def loads(data: bytes | str) -> Any:
        return orjson.loads(data)

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

    JSONDecodeError: type[Exception] = orjson.JSONDecodeError
except ImportError:  # pragma: no cover - exercised only where orjson is absent

    def loads(data: bytes | str) -> Any:
        return json.loads(data)

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()

    JSONDecodeError = ValueError
