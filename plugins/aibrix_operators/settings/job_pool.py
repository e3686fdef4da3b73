"""The deployment's limits on job-pool settings, from the ``[aibrix_batch]`` section.

Keys (all optional; defaults in ``JobPoolLimits``)::

    [aibrix_batch]
    pool_max_workers = 16                # max_workers a batch may ask for
    pool_max_concurrency = 4096          # concurrency (requests in flight per shard)
    pool_min_requests_per_shard = 1      # smaller shards: more tasks for the scheduler
    pool_max_memory_per_job = 8Gi        # memory_per_job of a driver pod
    gpu_policy = spread                  # how k8s/ places the serving group: pack | spread

A batch over a limit is refused by the limit's name (``batch/job_pool.py``), never clipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

from aibrix_operators import config_sections
from aibrix_operators.batch.job_pool import JobPoolError, JobPoolLimits

SECTION = config_sections.BATCH
# config key -> JobPoolLimits field
_KEYS = {
    "pool_max_workers": "max_workers",
    "pool_max_concurrency": "max_concurrency",
    "pool_min_requests_per_shard": "min_requests_per_shard",
    "pool_max_memory_per_job": "max_memory_per_job",
    "gpu_policy": "gpu_policy",
}


def load_job_pool_limits() -> JobPoolLimits:
    from airflow.sdk import conf

    return job_pool_limits(lambda key: conf.get(SECTION, key, fallback=None))


def job_pool_limits(get: Callable[[str], str | None]) -> JobPoolLimits:
    """The limits from a config getter (``get("pool_max_workers")``); a bad value names its key."""
    kinds = {f.name: f.type for f in fields(JobPoolLimits)}
    values: dict[str, object] = {}
    for key, name in _KEYS.items():
        raw = get(key)
        if raw is None or not raw.strip():
            continue
        if kinds[name] in (int, "int"):
            try:
                values[name] = int(raw.strip())
            except ValueError:
                raise JobPoolError(f"[{SECTION}] {key} = {raw!r} is not a whole number") from None
        else:
            values[name] = raw.strip()
    return JobPoolLimits(**values)  # type: ignore[arg-type]
