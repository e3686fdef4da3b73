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

from collections.abc import Callable

from aibrix_operators.batch.ordered_merge import merge_in_input_order
from aibrix_operators.batch.shard_answers import ExactlyOnceViolation, MergeSummary, shard_answers
from aibrix_operators.batch.sharding import ShardSpec
from aibrix_operators.storage import Storage, join_uri

__all__ = ["BATCH_FILE", "ERRORS_FILE", "OUTPUT_FILE", "ExactlyOnceViolation", "MergeSummary",
           "merge_results"]

OUTPUT_FILE = "output.jsonl"
ERRORS_FILE = "errors.jsonl"
BATCH_FILE = "batch.json"


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
            merge_in_input_order(storage, ordered, segments_of, summary, out.write, errs.write)
            return summary
        for shard in ordered:
            for _, line, failed in shard_answers(storage, shard, segments_of(shard), summary):
                (errs if failed else out).write(line + b"\n")
    return summary
