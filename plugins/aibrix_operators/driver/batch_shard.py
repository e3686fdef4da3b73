"""One shard of a batch, run by the driver: the pipeline's dispatch step without Airflow.

Here, not in ``batch/``: the batch core (validate, split, merge) knows nothing of how requests
are sent; the driver reads the core's layout (a shard's result log, the run's cancel marker).
"""

from __future__ import annotations

import dataclasses

from aibrix_operators.batch.job import cancel_marker_uri
from aibrix_operators.batch.shard_results import results_prefix
from aibrix_operators.batch.sharding import ShardSpec
from aibrix_operators.batch.stop_rules import stop_prefix
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.runner import run_shard
from aibrix_operators.driver.shard_outcome import ShardOutcome
from aibrix_operators.storage import Storage


async def run_shard_of_batch(
    storage: Storage, shard: ShardSpec, work: str, config: DriverConfig
) -> ShardOutcome:
    """Run one shard of the batch; the run's cancel marker is watched, and its stop rules' tallies
    kept under the run's stop prefix, unless told otherwise."""
    if config.cancel_uri is None:
        config = dataclasses.replace(config, cancel_uri=cancel_marker_uri(work))
    if config.stop_prefix is None:
        config = dataclasses.replace(config, stop_prefix=stop_prefix(work))
    return await run_shard(
        storage, shard.uri, results_prefix(work, shard.name), config,
        total=shard.num_requests, name=shard.name,
    )
