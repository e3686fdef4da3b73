"""One shard's answers in shard order, each request exactly once, counted into a summary.

The walk both merges share (``merging.py`` for contiguous shards, ``ordered_merge.py`` for
prefix-grouped ones): the first answer per ``custom_id`` in segment order wins (the earliest
attempt's, when two attempts overlapped), repeats are counted, and a request without an answer
or an answer without a request fails loudly instead of publishing a wrong result.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aibrix_operators.batch.jsonfast import loads
from aibrix_operators.batch.records import Usage
from aibrix_operators.batch.sharding import ShardSpec
from aibrix_operators.storage import Storage

log = logging.getLogger(__name__)


class ExactlyOnceViolation(Exception):
    """The results do not answer every request exactly once."""


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


# What the walk keeps of one answer: its line, and its error code (None: a success). Not the
# parsed record: a shard's parsed answers (choices, logprobs, ...) were the merge task's peak
# memory, several times the lines themselves; nor the usage object, which is added up as the
# segments are read (a first answer's usage counts whatever the walk finds after it: any other
# outcome fails the whole merge).
_Answer = tuple[bytes, str | None]


def _shard_results(storage: Storage, segments: list[str]) -> tuple[dict[str, _Answer], int, Usage]:
    """The first answer per ``custom_id`` in segment order, how many repeats were dropped, and
    the first answers' token usage."""
    results: dict[str, _Answer] = {}
    usage = Usage()
    repeats = 0
    for uri in segments:
        # Streamed: reading a segment whole held it twice (the blob and its split lines) on top
        # of the answers kept, the merge task's peak.
        with storage.open_read(uri) as src:
            for raw in src:
                line = raw.rstrip(b"\r\n")
                if not line:
                    continue
                record = loads(line)
                cid = record["custom_id"]
                if cid in results:
                    repeats += 1
                    continue
                error = record.get("error")
                if error is None:
                    usage.add_response_body(record["response"]["body"])
                    results[cid] = (line, None)
                else:
                    results[cid] = (line, str(error.get("code")))
    return results, repeats, usage


def shard_answers(
    storage: Storage, shard: ShardSpec, segments: list[str], summary: MergeSummary
) -> Iterator[tuple[int, bytes, bool]]:
    """``(position in the shard, result line, is an error)`` for each of the shard's requests in
    shard order, counted into ``summary``; raises ``ExactlyOnceViolation`` at the end if a request
    has no result or a result answers no request of the shard."""
    results, repeats, usage = _shard_results(storage, segments)
    summary.usage.merge(usage)
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
            found = results.pop(cid, None)
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
    if results:
        raise ExactlyOnceViolation(
            f"{shard.name}: {len(results)} result(s) for custom_ids that are not in the "
            f"shard, e.g. {list(results)[:5]}"
        )
