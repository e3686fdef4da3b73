"""Give the worker's freed heap back to the system after a step that walked a whole batch.

glibc keeps freed memory in its heap for reuse, and after a large block is freed it raises its
threshold for serving big allocations from the heap, so the growing arrays of a 1M-line
validation (tens of MB) stayed in the worker's RSS for every later task of the run
(`airflow dags test` runs them all in one process; bench/dag_at_scale.py). ``malloc_trim(0)``
returns that memory; it costs a few milliseconds. Elsewhere (musl, macOS) this is a no-op.

The raised threshold outlived the trim: glibc raises its trim threshold with it (to twice the
largest block freed), and from then on a heap kept a free top of up to that size. The heaps of
the threads a shard hands blocking work to (``asyncio.to_thread``: the shard's digest reads it
1 MiB at a time) kept theirs, ~4 MB each, which ``malloc_trim`` does not touch, and the worker's
RSS crept up ~0.8 MB a shard: 305-309 MB at 1M requests in `airflow dags test`. So the first
release also fixes glibc's thresholds for the rest of the process (``mallopt``, which turns the
raising off): blocks of 1 MiB and more are mapped and unmapped on their own, a heap gives back
a free top past 128 KiB (glibc's default) down to a 512 KiB pad. The pad, not glibc's 128 KiB,
so that the event loop's 256 KiB receive buffers (asyncio reads a socket 256 KiB at a time,
then shrinks the block) do not move the heap's end on every answer: 128 KiB cost ~3 % CPU in
the dispatch step, 512 KiB nothing measurable, and both held the 1M run at 292-295 MB.
"""

from __future__ import annotations

import ctypes
import functools

# glibc's mallopt parameters (malloc.h) and the values the worker keeps.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
TRIM_THRESHOLD_BYTES = 128 << 10
TOP_PAD_BYTES = 512 << 10
MMAP_THRESHOLD_BYTES = 1 << 20


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc, its thresholds fixed (once per process)."""
    try:
        libc = ctypes.CDLL(None)  # the process's own C library
        libc.malloc_trim, libc.mallopt  # noqa: B018 - both glibc's, or this is not glibc
    except (OSError, AttributeError):
        return None
    libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    libc.mallopt(M_TOP_PAD, TOP_PAD_BYTES)
    return libc


def release_freed_memory() -> None:
    """Return the C heap's free memory to the system, and keep returning it (glibc); nothing
    elsewhere."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
