"""A running batch's partial output: the answers of the shards that have ended, before merge.

Read the way merge reads a shard (``shard_answers``: the first answer per request, in the
shard's input order), so a partial read is line for line what the final output will hold for
those requests; error lines are left for the batch's error file. Streamed: what is held is one
shard's index of answers (merge's spill file), never its lines.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from aibrix_operators.batch.shard_answers import MergeSummary, shard_answers
from aibrix_operators.batch.shard_results import ResultLog, fingerprint_shard, results_prefix
from aibrix_operators.batch.sharding import ShardSpec
from aibrix_operators.storage import Storage

LINES_PER_CHUNK = 4096


def partial_answers(storage: Storage, shards: list[ShardSpec], done: Iterable[int],
                    work: str) -> Iterator[bytes]:
    """The answers of ``shards[i]`` for each ended shard ``i`` in ``done``, shard by shard, as
    chunks of whole lines. ``work``: the run's work prefix (``batch/job.work_prefix``)."""
    for index in sorted(done):
        shard = shards[index]
        binding = fingerprint_shard(storage, shard.uri).binding
        log = ResultLog(storage, results_prefix(work, shard.name), binding)
        pending: list[bytes] = []
        for _, line, is_error in shard_answers(storage, shard, log.segments(), MergeSummary("", "")):
            if is_error:
                continue
            pending.append(line + b"\n")
            if len(pending) == LINES_PER_CHUNK:
                yield b"".join(pending)
                pending.clear()
        if pending:
            yield b"".join(pending)
