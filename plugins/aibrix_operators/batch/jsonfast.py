"""JSON encode/decode: orjson, a hard dependency (requirements.txt, the driver image).

The validator and driver handle millions of lines; orjson is several times
faster than ``json``. It is also stricter, and that is why there is no stdlib
fallback: ``json`` accepts ``NaN``/``Infinity`` and lone ``\\ud800`` escapes that
the driver then cannot send (orjson refuses to encode them), so a file that a
fallback validated would crash the driver on every retry. The functions are
bound directly (no wrapper) because callers use them once per line.
"""

from __future__ import annotations

import orjson

loads = orjson.loads
dumps = orjson.dumps
JSONDecodeError: type[ValueError] = orjson.JSONDecodeError

__all__ = ["JSONDecodeError", "dumps", "loads"]
