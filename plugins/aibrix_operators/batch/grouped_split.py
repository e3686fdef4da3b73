"""Split a validated file into shards in prefix-grouped order (prefix-aware sharding).

Validation wrote the send order (``batch/prefixes.py``): request indices sorted so that
requests sharing a prompt prefix are contiguous, the first of each group first. This lays
the requests out in that order and cuts the sequence with exactly ``split_file``'s rule
(close a shard before a line that would pass the request or byte limit), so

* a prefix group lands in one shard, back to back, unless a shard boundary falls inside it
  (at most one cut per boundary: a group bigger than a shard spans several shards, each
  warming its cache once);
* ``plan_shards``' bound on the shard count holds (it is a bound for any order of the same
  lines), so the count stays within ``max_map_length``; request counts are evened out
  (``ceil(N / shards)`` each) instead of leaving one small remainder shard.

Lines are gathered with ``os.pread`` at the offsets validation recorded, one shard at a time:
memory is the order and offsets (16 bytes per request) plus one line. An ``s3://`` input is
first copied to a local temporary file (random reads of single lines from S3 would cost one
request each). Each shard also gets ``<shard>.lines``: the input line number of each of its
lines, which merge uses to write results back in input order.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from aibrix_operators.batch.sharding import ShardPlan, ShardSpec, shard_uri
from aibrix_operators.batch.validation import ValidationReport
from aibrix_operators.storage import Storage

_COPY_CHUNK = 8 * 1024 * 1024


def lines_uri(shard: str) -> str:
    return shard[: -len(".jsonl")] + ".lines" if shard.endswith(".jsonl") else shard + ".lines"


def read_shard_lines(storage: Storage, uri: str) -> np.ndarray:
    """The input line numbers of a grouped shard's lines, in shard order."""
    return np.frombuffer(storage.read_bytes(uri), dtype="<i8")


def cut_points(sizes: list[int], max_requests: int, max_bytes: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of ``sizes`` cut like ``split_file``: a shard closes before a
    line that would take it past ``max_requests`` lines or ``max_bytes`` bytes."""
    cuts: list[tuple[int, int]] = []
    start = n = b = 0
    for k, size in enumerate(sizes):
        if n and (n >= max_requests or b + size > max_bytes):
            cuts.append((start, k))
            start, n, b = k, 0, 0
        n += 1
        b += size
    if n:
        cuts.append((start, len(sizes)))
    return cuts


@contextmanager
def _local_fd(storage: Storage, input_uri: str) -> Iterator[int]:
    """A file descriptor for random reads of the input: the file itself, or a local copy."""
    with storage.open_read(input_uri) as src:
        try:
            fd = src.fileno()
            seekable = src.seekable()
        except (OSError, ValueError, AttributeError):
            fd, seekable = -1, False
        if fd >= 0 and seekable:
            yield fd
            return
        with tempfile.TemporaryFile(prefix="aibrix-split-") as copy:
            shutil.copyfileobj(src, copy, _COPY_CHUNK)
            copy.flush()
            yield copy.fileno()


def _even_cuts(sizes: np.ndarray, max_requests: int, max_bytes: int) -> list[tuple[int, int]] | None:
    """The cuts when only the request limit binds (the usual case), found without a Python loop."""
    starts = np.arange(0, len(sizes), max_requests)
    if len(sizes) and int(np.add.reduceat(sizes, starts).max()) > max_bytes:
        return None
    return [(int(a), min(int(a) + max_requests, len(sizes))) for a in starts]


def _model_runs(models: np.ndarray | None, n: int) -> list[tuple[int, int]]:
    """``[start, stop)`` runs of one model in send order (the whole range without models)."""
    if models is None or n == 0:
        return [(0, n)]
    edges = (np.flatnonzero(models[1:] != models[:-1]) + 1).tolist()
    return list(zip([0, *edges], [*edges, n], strict=True))


def split_grouped(
    storage: Storage,
    input_uri: str,
    work_prefix: str,
    report: ValidationReport,
    plan: ShardPlan,
    order: np.ndarray,
    offsets: np.ndarray,
    models: np.ndarray | None = None,
    adapters: list[str] | None = None,
) -> list[ShardSpec]:
    """Write the requests into shard files in ``order`` (0-based request indices).

    With ``models`` (per request in input order: 0 the base model, k ``adapters[k - 1]``), no
    shard holds two models: a shard's adapter is loaded before it runs, and an adapter that
    fails to load fails only its own shards.
    """
    if not report.ok:
        raise ValueError("refusing to split a file that failed validation")
    total = report.total_requests
    if len(order) != total or len(offsets) != total + 1:
        raise RuntimeError(f"the prefix order covers {len(order)} requests but validation counted "
                           f"{total}; {input_uri} changed between validation and split")
    sizes = np.diff(offsets)
    end = int(offsets[-1])
    shards_needed = max(1, math.ceil(total / plan.requests_per_shard))
    max_requests = math.ceil(total / shards_needed)
    shards: list[ShardSpec] = []
    with _local_fd(storage, input_uri) as fd:
        if os.fstat(fd).st_size != report.total_bytes:
            raise RuntimeError(f"{input_uri} is {os.fstat(fd).st_size} bytes but validation read "
                               f"{report.total_bytes}; it changed between validation and split")
        # Only the very last line of a file may lack its newline; split adds one.
        last_open = total > 0 and os.pread(fd, 1, end - 1) != b"\n"
        written = sizes.copy()
        if last_open:
            written[total - 1] += 1
        permuted = written[order]
        sent_models = models[order] if models is not None else None
        cuts: list[tuple[int, int]] = []
        for a, b in _model_runs(sent_models, total):
            run = permuted[a:b]
            cuts += [(a + start, a + stop) for start, stop in
                     (_even_cuts(run, max_requests, plan.bytes_per_shard)
                      or cut_points(run.tolist(), max_requests, plan.bytes_per_shard))]
        pread = os.pread
        for start, stop in cuts:
            model = int(sent_models[start]) if sent_models is not None else 0
            idxs = order[start:stop]
            uri = shard_uri(work_prefix, len(shards))
            # Plain lists per shard: numpy scalar indexing per line costs more than the read.
            rows = zip(idxs.tolist(), sizes[idxs].tolist(), offsets[idxs].tolist(), strict=True)
            with storage.open_write(uri) as out:
                write = out.write
                for i, size, offset in rows:
                    line = pread(fd, size, offset)
                    if not line.endswith(b"\n"):
                        if i != total - 1 or len(line) != size:
                            raise RuntimeError(f"line {i + 1} of {input_uri} is not where validation "
                                               "found it; the file changed between validation and split")
                        line += b"\n"
                    write(line)
            numbers = (idxs + 1).astype("<i8")
            luri = lines_uri(uri)
            storage.write_bytes(luri, numbers.tobytes())
            shards.append(ShardSpec(len(shards), uri, int(numbers[0]), len(idxs),
                                    int(permuted[start:stop].sum()), luri,
                                    adapters[model - 1] if model and adapters else None))
    return shards
