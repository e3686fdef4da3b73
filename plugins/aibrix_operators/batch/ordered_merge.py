"""Merge the results of prefix-grouped shards back into input order with bounded memory.

A grouped shard holds lines from all over the input (``ShardSpec.lines_uri`` lists their
input line numbers), so walking shards one after the other, as the contiguous case does,
would write the output out of order. Instead, an external merge:

1. per shard, the exactly-once walk of ``shard_answers.shard_answers`` (first answer per
   ``custom_id`` wins, repeats counted, missing/unknown ids fail), each answer tagged with its
   input line number; the shard's answers are sorted by it and written to a local run file.
   Memory: one shard's results, the bound merge always had;
2. a k-way merge (``heapq.merge``) of the run files by line number, each answer going to
   ``output.jsonl`` or ``errors.jsonl``. Memory: one line and one read buffer per shard.

A run line is ``<12-digit line number><o|e><result JSON>``: fixed-width numbers compare as
bytes in numeric order, so the merge compares raw lines without parsing them. The run files
live in a local temporary directory (disk: about the size of the output) and are removed
at the end.
"""

from __future__ import annotations

import heapq
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from aibrix_operators.batch.grouped_split import read_shard_lines
from aibrix_operators.batch.shard_answers import MergeSummary, shard_answers
from aibrix_operators.batch.sharding import ShardSpec
from aibrix_operators.storage import Storage

_WIDTH = 12  # line numbers up to 10^12, far above any batch
_READ_BUFFER = 64 * 1024


def _line_numbers(storage: Storage, shard: ShardSpec) -> Any:
    if shard.lines_uri:
        numbers = read_shard_lines(storage, shard.lines_uri)
        if len(numbers) != shard.num_requests:
            raise RuntimeError(f"{shard.name}: {shard.lines_uri} lists {len(numbers)} lines, the "
                               f"shard holds {shard.num_requests}")
        return numbers
    return range(shard.first_line, shard.first_line + shard.num_requests)


def merge_in_input_order(
    storage: Storage,
    shards: list[ShardSpec],
    segments_of: Callable[[ShardSpec], list[str]],
    summary: MergeSummary,
    write_output: Callable[[bytes], Any],
    write_error: Callable[[bytes], Any],
) -> None:
    with tempfile.TemporaryDirectory(prefix="aibrix-merge-") as tmp:
        runs: list[Path] = []
        for shard in shards:
            numbers = _line_numbers(storage, shard)
            numbers = numbers.tolist() if hasattr(numbers, "tolist") else numbers
            tagged = [
                b"%0*d%s%s\n" % (_WIDTH, numbers[pos], b"e" if failed else b"o", line)
                for pos, line, failed in shard_answers(storage, shard, segments_of(shard), summary)
            ]
            tagged.sort()
            run = Path(tmp) / f"{shard.name}.run"
            with open(run, "wb") as fh:
                fh.writelines(tagged)
            del tagged
            runs.append(run)
        with ExitStack() as stack:
            files = [stack.enter_context(open(r, "rb", buffering=_READ_BUFFER)) for r in runs]
            for tagged_line in heapq.merge(*files):
                body = tagged_line[_WIDTH + 1:]
                if tagged_line[_WIDTH] == 0x65:  # b"e"
                    write_error(body)
                else:
                    write_output(body)
