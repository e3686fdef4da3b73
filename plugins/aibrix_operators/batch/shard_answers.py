"""One shard's answers in shard order, each request exactly once, counted into a summary.

The walk both merges share (``merging.py`` for contiguous shards, ``ordered_merge.py`` for
prefix-grouped ones): the first answer per ``custom_id`` in segment order wins (the earliest
attempt's, when two attempts overlapped), repeats are counted, and a request without an answer
or an answer without a request fails loudly instead of publishing a wrong result.
"""

from __future__ import annotations

import logging
import os
import tempfile
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from aibrix_operators.batch.error_codes import BatchFailure, CodedFailure
from aibrix_operators.batch.jsonfast import loads
from aibrix_operators.batch.records import Usage
from aibrix_operators.batch.sharding import ShardSpec
from aibrix_operators.storage import Storage

log = logging.getLogger(__name__)


class ExactlyOnceViolation(CodedFailure):
    """The results do not answer every request exactly once."""

    error_code, retryable = BatchFailure.EXACTLY_ONCE_VIOLATION, False


@dataclass
class MergeSummary:
    output_uri: str
    errors_uri: str
    total: int = 0
    completed: int = 0
    failed: int = 0
    usage: Usage = field(default_factory=Usage)
    error_codes: dict[str, int] = field(default_factory=dict)
    duplicates_discarded: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "output_uri": self.output_uri,
            "errors_uri": self.errors_uri,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "usage": self.usage.as_dict(),
            "error_codes": self.error_codes,
            "duplicates_discarded": self.duplicates_discarded,
        }


_WINDOW_BYTES = 1 << 20


class _FirstAnswers:
    """A shard's first answer per ``custom_id``, their lines parked in a local spill file.

    What stays in memory per answer is its ``custom_id``, an index and an offset (~130
    bytes), not its line: a shard's lines (~440 bytes each for a short chat answer) were the
    merge task's peak memory, and before them its parsed records, several times more. The
    spill is written once, in segment order, and read back line by line in shard order; it is
    a local temporary file whatever the store, so reading back never costs a request to S3.
    """

    def __init__(self, spill: BinaryIO) -> None:
        self._spill = spill
        self.index: dict[str, int] = {}
        self._offsets = array("q", [0])
        # Only failed answers have a code; most answers are successes.
        self._codes: dict[int, str] = {}
        self.usage = Usage()
        self.repeats = 0
        self._window, self._window_at = b"", 0

    def read(self, storage: Storage, segments: list[str]) -> None:
        """The first answer per ``custom_id`` in segment order; repeats are counted, and the first
        answers' token usage added up as they are read."""
        offsets, index, codes = self._offsets, self.index, self._codes
        # Lines go to the spill a few thousand at a time: a write per line cost more than the
        # spill saved.
        pending: list[bytes] = []
        end = 0
        for uri in segments:
            # Streamed: a segment is never held whole.
            with storage.open_read(uri) as src:
                for raw in src:
                    line = raw.rstrip(b"\r\n")
                    if not line:
                        continue
                    record = loads(line)
                    cid = record["custom_id"]
                    if cid in index:
                        self.repeats += 1
                        continue
                    error = record.get("error")
                    if error is None:
                        self.usage.add_response_body(record["response"]["body"])
                    else:
                        codes[len(index)] = str(error.get("code"))
                    index[cid] = len(index)
                    pending.append(line)
                    end += len(line)
                    offsets.append(end)
                    if len(pending) == 4096:
                        self._spill.write(b"".join(pending))
                        pending.clear()
        self._spill.write(b"".join(pending))
        self._spill.flush()

    def pop(self, cid: str) -> tuple[bytes, str | None] | None:
        """The answer's line and its error code (None: a success), or None if there is none."""
        i = self.index.pop(cid, None)
        if i is None:
            return None
        start, stop = self._offsets[i], self._offsets[i + 1]
        at = self._window_at
        if not (at <= start and stop <= at + len(self._window)):
            # Answers come back about in send order, so shard order walks the spill forward
            # with small jumps: one read of a window serves the next thousand lines or so.
            at = self._window_at = max(0, start - _WINDOW_BYTES // 8)
            self._window = os.pread(self._spill.fileno(), max(_WINDOW_BYTES, stop - at), at)
        return self._window[start - at:stop - at], self._codes.get(i)


def shard_answers(
    storage: Storage, shard: ShardSpec, segments: list[str], summary: MergeSummary
) -> Iterator[tuple[int, bytes, bool]]:
    """``(position in the shard, result line, is an error)`` for each of the shard's requests in
    shard order, counted into ``summary``; raises ``ExactlyOnceViolation`` at the end if a request
    has no result or a result answers no request of the shard."""
    with tempfile.TemporaryFile(prefix="aibrix-merge-") as spill:
        results = _FirstAnswers(spill)
        results.read(storage, segments)
        yield from _in_shard_order(storage, shard, results, summary)


def _in_shard_order(
    storage: Storage, shard: ShardSpec, results: _FirstAnswers, summary: MergeSummary
) -> Iterator[tuple[int, bytes, bool]]:
    summary.usage.merge(results.usage)
    repeats = results.repeats
    if repeats:
        log.warning("%s: %d repeated answer(s) from overlapping attempts discarded; the "
                    "first answer per custom_id is kept", shard.name, repeats)
        summary.duplicates_discarded += repeats
    missing: list[str] = []
    position = -1
    with storage.open_read(shard.uri) as src:
        for raw in src:
            if not raw.strip():
                continue
            position += 1
            cid = loads(raw)["custom_id"]
            found = results.pop(cid)
            if found is None:
                missing.append(cid)
                continue
            line, code = found
            summary.total += 1
            if code is None:
                summary.completed += 1
                yield position, line, False
            else:
                summary.failed += 1
                summary.error_codes[code] = summary.error_codes.get(code, 0) + 1
                yield position, line, True
    if missing:
        raise ExactlyOnceViolation(
            f"{shard.name}: {len(missing)} request(s) have no result, e.g. {missing[:5]}; "
            "re-run the shard's dispatch task (it resumes where it stopped)"
        )
    if results.index:
        raise ExactlyOnceViolation(
            f"{shard.name}: {len(results.index)} result(s) for custom_ids that are not in the "
            f"shard, e.g. {list(results.index)[:5]}"
        )
