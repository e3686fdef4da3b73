"""Merge shard results into ``output.jsonl``, ``errors.jsonl`` and ``batch.json``.

This is where the exactly-once invariant is enforced: every input
``custom_id`` appears exactly once across output ∪ errors. A request can be
answered more than once when two attempts of a shard overlap (a zombie worker,
an orphaned pod, a resend after a kill): the first answer in segment order —
the earliest attempt's — is kept and the repeats are counted. A missing or
unknown id fails the merge loudly instead of publishing a wrong result.
Output is in input order, also when split reordered requests by prefix;
memory is bounded by one shard's results.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from aibrix_operators.batch.jsonfast import loads
from aibrix_operators.batch.records import Usage
from aibrix_operators.batch.sharding import ShardSpec
from aibrix_operators.storage import Storage, join_uri

OUTPUT_FILE = "output.jsonl"
ERRORS_FILE = "errors.jsonl"
log = logging.getLogger(__name__)
BATCH_FILE = "batch.json"


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


def _shard_results(
    storage: Storage, segments: list[str]
) -> tuple[dict[str, tuple[bytes, dict[str, Any]]], int]:
    """The first answer per ``custom_id`` in segment order, and how many repeats were dropped."""
    results: dict[str, tuple[bytes, dict[str, Any]]] = {}
    repeats = 0
    for uri in segments:
        for line in storage.read_bytes(uri).splitlines():
            if not line:
                continue
            record = loads(line)
            cid = record["custom_id"]
            if cid in results:
                repeats += 1
                continue
            results[cid] = (line, record)
    return results, repeats


def merge_results(
    storage: Storage,
    shards: list[ShardSpec],
    segments_of: Callable[[ShardSpec], list[str]],
    output_prefix: str,
) -> MergeSummary:
    """Write output and error files under ``output_prefix`` from every shard's results.

    Shards of contiguous lines are written one after the other. When split grouped requests by
    prefix (shards with ``lines_uri``), each shard's results are sorted by input line number
    into a local run file and the runs are merged (``batch/ordered_merge.py``): output is in
    input order either way, and memory stays bounded by one shard's results.
    """
    summary = MergeSummary(join_uri(output_prefix, OUTPUT_FILE), join_uri(output_prefix, ERRORS_FILE))
    ordered = sorted(shards, key=lambda s: s.index)
    with storage.open_write(summary.output_uri) as out, storage.open_write(summary.errors_uri) as errs:
        if any(s.lines_uri for s in ordered):
            from aibrix_operators.batch.ordered_merge import merge_in_input_order

            merge_in_input_order(storage, ordered, segments_of, summary, out.write, errs.write)
            return summary
        for shard in ordered:
            for _, line, failed in shard_answers(storage, shard, segments_of(shard), summary):
                (errs if failed else out).write(line + b"\n")
    return summary


def shard_answers(
    storage: Storage, shard: ShardSpec, segments: list[str], summary: MergeSummary
) -> Iterator[tuple[int, bytes, bool]]:
    """``(position in the shard, result line, is an error)`` for each of the shard's requests in
    shard order, counted into ``summary``; raises ``ExactlyOnceViolation`` at the end if a request
    has no result or a result answers no request of the shard."""
    results, repeats = _shard_results(storage, segments)
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
            line, record = found
            summary.total += 1
            if record.get("error") is None:
                summary.completed += 1
                summary.usage.add_response_body(record["response"]["body"])
                yield position, line, False
            else:
                summary.failed += 1
                code = str(record["error"].get("code"))
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
