"""JSON encode/decode with orjson when it is installed, the stdlib otherwise.

The validator and driver handle millions of lines; orjson is several times
faster than ``json`` and rejects invalid UTF-8 on its own. The orjson functions
are bound directly (no wrapper) because callers use them once per line.
"""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson

    loads = orjson.loads
    dumps = orjson.dumps
    JSONDecodeError: type[Exception] = orjson.JSONDecodeError
except ImportError:  # pragma: no cover - exercised only where orjson is absent

    def loads(data: bytes | str) -> Any:
        return json.loads(data)

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()

    JSONDecodeError = ValueError
