"""Give the worker's freed heap back to the system after a step that walked a whole batch.

glibc keeps freed memory in its heap for reuse, and after a large block is freed it raises its
threshold for serving big allocations from the heap, so the growing arrays of a 1M-line
validation (tens of MB) stayed in the worker's RSS for every later task of the run
(`airflow dags test` runs them all in one process; bench/dag_at_scale.py). ``malloc_trim(0)``
returns that memory; it costs a few milliseconds. Elsewhere (musl, macOS) this is a no-op.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # the process's own C library
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Return the C heap's free memory to the system (glibc); nothing elsewhere."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
