"""One line of a batch file parsed as JSON, and, when it is not JSON, the code that says why.

Validation's line loop calls ``parse_line`` for every line; the common case is one ``loads``. The
failure path tells apart what a user fixes differently: the encoding, NaN/Infinity and lone
surrogates (which Python's ``json`` accepts but the server cannot take), a truncated last line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aibrix_operators.batch.error_codes import ValidationCode
from aibrix_operators.batch.jsonfast import loads

# Where a line's error goes: (line number, code, message).
Report = Callable[[int, str, str], None]


def parse_line(raw: bytes, line_no: int, had_newline: bool, report: Report) -> Any:
    """The line's JSON value, or None after reporting why it is not one (``report(line, code,
    message)``): not UTF-8, a JSON extension the server cannot take, cut short, or plain invalid."""
    try:
        return loads(raw)
    except ValueError as exc:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as ude:
            report(line_no, ValidationCode.INVALID_ENCODING,
                   f"line is not valid UTF-8 (byte offset {ude.start} in the line); "
                   "re-encode the file as UTF-8")
            return None
        special = _non_standard_json(raw, exc)
        if special is not None:
            report(line_no, *special)
        elif not had_newline:
            report(line_no, ValidationCode.TRUNCATED_LINE,
                   f"last line is not complete JSON and has no final newline; the file looks "
                   f"truncated ({exc})")
        else:
            report(line_no, ValidationCode.INVALID_JSON_LINE, f"line is not valid JSON: {exc}")
        return None


_NON_FINITE = ("NaN", "Infinity", "-Infinity")


def _non_standard_json(raw: bytes, exc: ValueError) -> tuple[str, str] | None:
    """``(code, message)`` for the extensions Python's ``json`` accepts but JSON does not.

    ``NaN``/``Infinity`` (and numbers that overflow to infinity) and lone UTF-16
    surrogate escapes (``"\\ud800"``) parse in the stdlib but cannot be encoded
    again for the server, so they get codes of their own rather than a generic
    syntax error. orjson's messages and ``pos`` (a character offset) tell them apart.
    """
    text = str(exc)
    if "surrogate" in text:
        return (ValidationCode.LONE_SURROGATE,
                "line has a \\ud800-\\udfff escape without its pair (a lone UTF-16 surrogate), "
                "which is not a Unicode character; fix the text's encoding")
    if "infinity" in text:
        return (ValidationCode.INVALID_NUMBER,
                "line has a number too large for a 64-bit float; JSON numbers must be finite")
    pos = getattr(exc, "pos", None)
    if isinstance(pos, int):
        # ``pos`` counts characters; only the few around it are decoded.
        around = raw.decode("utf-8", errors="replace")[max(pos - 1, 0): pos + len("Infinity")]
        if any(around.startswith(w) or around[1:].startswith(w) for w in _NON_FINITE):
            return (ValidationCode.INVALID_NUMBER,
                    "line has NaN or Infinity, which are not valid JSON numbers; "
                    "use null or a finite number")
    return None
