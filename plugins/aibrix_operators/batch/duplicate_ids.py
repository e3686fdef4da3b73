"""Duplicate ``custom_id``s, found at the end of a streamed validation.

While streaming, ``validation.py`` keeps 12 bytes per request: a 64-bit hash of its id and its
line number. Lines whose hashes collide are suspects; when the file can be read again
(``reopen``) their ids are read back, so a hash collision between two different ids is never
reported, and each duplicate names the line of the first occurrence.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import BinaryIO

from aibrix_operators.batch.jsonfast import loads
from aibrix_operators.batch.jsonl_lines import UTF8_BOM, read_lines


def duplicate_ids(
    hashes: array, lines: array, reopen: Callable[[], BinaryIO] | None, max_line: int
) -> list[tuple[int, int, str | None]]:
    """``(line, line of the first occurrence, the id)`` of each duplicate, in line order; the id
    is ``None`` when the file cannot be read again (then the lines are judged by the hashes)."""
    suspects = lines_with_colliding_hashes(hashes, lines)
    if not suspects:
        return []
    ids_at = ids_at_lines(reopen, suspects, max_line) if reopen else None
    # Judged by the ids read back, or, when the file cannot be read again, by their hashes.
    keys: dict[int, int] | dict[int, str] = ids_at if ids_at is not None else suspects
    first: dict[object, int] = {}
    found: list[tuple[int, int, str | None]] = []
    for n in sorted(keys):
        key = keys[n]
        if key in first:
            found.append((n, first[key], key if ids_at is not None else None))  # type: ignore[arg-type]
        else:
            first[key] = n
    return found


def lines_with_colliding_hashes(hashes: array, lines: array) -> dict[int, int]:
    """Line numbers whose id hash occurs more than once → that hash."""
    if len(hashes) < 2:
        return {}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        seen: dict[int, list[int]] = {}
        for h, n in zip(hashes, lines, strict=True):
            seen.setdefault(h, []).append(n)
        return {n: h for h, ns in seen.items() if len(ns) > 1 for n in ns}
    h = np.frombuffer(hashes, dtype=np.int64)
    # Most files have no duplicates: a plain sort answers that with less memory than argsort.
    sorted_h = np.sort(h)
    if not (sorted_h[1:] == sorted_h[:-1]).any():
        return {}
    del sorted_h
    order = np.argsort(h, kind="stable")
    sorted_h = h[order]
    same_as_next = sorted_h[1:] == sorted_h[:-1]
    if not same_as_next.any():
        return {}
    dup = np.zeros(len(sorted_h), dtype=bool)
    dup[1:] |= same_as_next
    dup[:-1] |= same_as_next
    ln = np.frombuffer(lines, dtype=np.int64 if lines.itemsize == 8 else np.int32)
    return {int(ln[i]): int(sorted_h[j]) for j, i in enumerate(order) if dup[j]}


def ids_at_lines(
    reopen: Callable[[], BinaryIO], wanted: dict[int, int], max_line: int
) -> dict[int, str]:
    found: dict[int, str] = {}
    with reopen() as stream:
        for line_no, (raw, too_long, _) in enumerate(read_lines(stream, max_line), start=1):
            if line_no in wanted and not too_long:
                found[line_no] = loads(raw.lstrip(UTF8_BOM))["custom_id"]
                if len(found) == len(wanted):
                    break
    return found
