"""CPU copies of whole chunks, each followed by the checksum of every byte it moved.

A full L1 check reads every byte once more than the copy does. Hashing a chunk right
after copying it reads bytes that are still in this core's caches, so the check costs
little memory bandwidth; what is left is the hash's compute, and that scales with cores:
each core copies and hashes its own share of the chunks.

The copies use numpy (one thread per call, the GIL released) rather than ``torch``: torch
would start its own intra-op threads from every calling thread and oversubscribe the cores.
``host_threads`` never uses more threads than the cores this thread may run on, so a vLLM
CPU worker bound to one core (``VLLM_CPU_OMP_THREADS_BIND``) does everything inline.

Measured with ``bench/kvcache_l1_bandwidth.py`` (docs/kvcache.md has the numbers).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

from kvcache import codec


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's bytes (any dtype: bf16 and fp8 have no numpy type).
    The last dimension must be contiguous."""
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    return tensor.view(torch.uint8).numpy()


@dataclass
class ChunkCopy:
    """Copy each ``(dst, src)`` pair, then checksum ``checked`` (the chunk's L1 slot:
    the source of a load, the destination of a store)."""

    pairs: list[tuple[np.ndarray, np.ndarray]]
    checked: np.ndarray


def chunk_copy(
    blocks: np.ndarray, rows: np.ndarray, row0: int, moves: list[tuple[int, int]], n_rows: int, into_kv: bool
) -> ChunkCopy:
    """One chunk's copy between the paged blocks (``blocks``: one layer, block axis first)
    and its slot (``rows[row0 : row0 + n_rows]``); ``moves``: (row in the chunk, block id).
    Runs of consecutive rows and blocks move as one slice."""
    pairs = []
    i = 0
    while i < len(moves):
        r, b = moves[i]
        n = 1
        while i + n < len(moves) and moves[i + n] == (r + n, b + n):
            n += 1
        kv_part, host_part = blocks[b : b + n], rows[row0 + r : row0 + r + n]
        pairs.append((kv_part, host_part) if into_kv else (host_part, kv_part))
        i += n
    return ChunkCopy(pairs, rows[row0 : row0 + n_rows])


def _run(copies: list[ChunkCopy]) -> list[int]:
    out = []
    for c in copies:
        for dst, src in c.pairs:
            np.copyto(dst, src)
        out.append(codec.checksum_bytes(c.checked))
    return out


def usable_cores() -> int:
    """The cores this thread may run on (vLLM pins a CPU worker's threads to its bound cores)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def host_threads() -> int:
    """Threads for chunk copies: torch's intra-op thread count, but no more than usable cores."""
    return max(1, min(usable_cores(), torch.get_num_threads()))


class ChunkCopier:
    """Runs ``ChunkCopy`` lists over ``threads`` threads (the caller's counts as one)."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = None
        if self.threads > 1:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvcache-copy")

    def run(self, copies: list[ChunkCopy]) -> list[int]:
        """Checksums of ``checked``, in order, after every copy is done."""
        n = min(self.threads, len(copies))
        if n <= 1 or self._pool is None:
            return _run(copies)
        # Contiguous shares: each thread walks adjacent memory.
        bounds = [len(copies) * k // n for k in range(n + 1)]
        futures = [self._pool.submit(_run, copies[bounds[k] : bounds[k + 1]]) for k in range(1, n)]
        try:
            out = _run(copies[: bounds[1]])
        finally:
            wait(futures)  # no copy may outlive the call: its caller releases the slots next
        for f in futures:
            out.extend(f.result())
        return out

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
