"""Duplicate ``custom_id``s, found at the end of a streamed validation.

While streaming, ``validation.py`` records each request's 64-bit id hash and line number in an
``IdHashLog``. Lines whose hashes collide are suspects; when the file can be read again
(``reopen``) their ids are read back, so a hash collision between two different ids is never
reported, and each duplicate names the line of the first occurrence.

Memory: the log holds at most ``SPILL_AT`` pairs (~3 MB). A larger batch's pairs go, chunk by
chunk, to ``BUCKETS`` anonymous temporary files by the hash's top bits: equal hashes land in the
same bucket, so each bucket is checked alone and the validating process holds one bucket at a
time (10,000,000 requests: 160 MB on local disk, ~2.5 MB per bucket in memory) instead of 16
bytes per request.
"""

from __future__ import annotations

import tempfile
from array import array
from collections.abc import Callable
from typing import BinaryIO

import numpy as np

from aibrix_operators.batch.jsonfast import loads
from aibrix_operators.batch.jsonl_lines import UTF8_BOM, read_lines

# Pairs held in memory before they go to the bucket files, and how many buckets (top bits).
SPILL_AT = 1 << 18
BUCKET_BITS = 6
BUCKETS = 1 << BUCKET_BITS


class IdHashLog:
    """Every valid request's id hash and line number, in memory up to ``spill_at`` pairs and
    in bucket files beyond. Validation's hot loop appends to ``hashes`` and ``lines`` directly
    and calls ``spill()`` whenever ``len(hashes)`` reaches ``spill_at``."""

    def __init__(self, spill_at: int | None = None) -> None:
        self.spill_at = spill_at or SPILL_AT
        self.hashes = array("q")
        self.lines = array("q")
        self._buckets: list[BinaryIO] | None = None

    @property
    def spilled(self) -> bool:
        return self._buckets is not None

    def spill(self) -> None:
        """Move the pairs in memory to their buckets' files (emptying the arrays in place: the
        hot loop keeps their bound ``append``)."""
        if not self.hashes:
            return
        if self._buckets is None:
            self._buckets = [tempfile.TemporaryFile(prefix="aibrix-ids-") for _ in range(BUCKETS)]
        h = np.frombuffer(self.hashes, dtype=np.int64)
        ln = np.frombuffer(self.lines, dtype=np.int64)
        bucket = (h.view(np.uint64) >> np.uint64(64 - BUCKET_BITS)).astype(np.uint8)
        order = np.argsort(bucket, kind="stable")
        ends = np.cumsum(np.bincount(bucket, minlength=BUCKETS))
        start = 0
        # One bucket's pairs at a time (~4,000 of them), not all the spill's pairs in one array:
        # that array and its gathers were validation's memory peak at 1,000,000 requests
        # (bench/dag_at_scale.py). The files get the same bytes.
        for k, end in enumerate(ends.tolist()):
            if end > start:
                rows = order[start:end]
                pairs = np.empty((len(rows), 2), dtype=np.int64)
                pairs[:, 0] = h[rows]
                pairs[:, 1] = ln[rows]
                pairs.tofile(self._buckets[k])
            start = end
        del h, ln  # the arrays can be emptied only once no view exports their buffers
        del self.hashes[:], self.lines[:]

    def colliding(self) -> dict[int, int]:
        """Line numbers whose id hash occurs more than once → that hash; closes the buckets."""
        if self._buckets is None:
            return lines_with_colliding_hashes(self.hashes, self.lines)
        self.spill()
        found: dict[int, int] = {}
        try:
            for fh in self._buckets:
                fh.seek(0)
                pairs = np.fromfile(fh, dtype=np.int64).reshape(-1, 2)
                found.update(_colliding(np.ascontiguousarray(pairs[:, 0]), pairs[:, 1]))
        finally:
            self.close()
        return found

    def close(self) -> None:
        for fh in self._buckets or ():
            fh.close()
        self._buckets = None


def duplicate_ids(
    ids: IdHashLog, reopen: Callable[[], BinaryIO] | None, max_line: int
) -> list[tuple[int, int, str | None]]:
    """``(line, line of the first occurrence, the id)`` of each duplicate, in line order; the id
    is ``None`` when the file cannot be read again (then the lines are judged by the hashes)."""
    suspects = ids.colliding()
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
    return _colliding(np.frombuffer(hashes, dtype=np.int64),
                      np.frombuffer(lines, dtype=np.int64 if lines.itemsize == 8 else np.int32))


def _colliding(h: np.ndarray, ln: np.ndarray) -> dict[int, int]:
    if len(h) < 2:
        return {}
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
