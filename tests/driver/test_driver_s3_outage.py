"""The object store going away mid-shard: a real SeaweedFS stopped while the driver
checkpoints to it. The task fails within the bounded retry time; once the store is
back, a retry completes the shard with no request lost or answered twice."""

from __future__ import annotations

import asyncio
import time

import pytest

from aibrix_operators.driver.checkpoint import CheckpointWriteFailed
from aibrix_operators.driver.runner import run_shard
from aibrix_operators.storage import S3Storage
from tests.driver.test_driver_faults import config, results_by_id
from tests.integration.services import start_seaweedfs, stop_group

pytestmark = [pytest.mark.service, pytest.mark.waits]  # its own lane: docs/testing.md

BUCKET = "ckpt"
N = 400


async def test_store_stopped_mid_shard_fails_task_then_retry_completes(tmp_path, fault_server, make_request):
    import json

    data = tmp_path / "weed"
    server = start_seaweedfs(data, "ckpt-key", "ckpt-secret")
    try:
        server.client().create_bucket(Bucket=BUCKET)
        storage = S3Storage(client=server.client())
        records = [make_request(f"s3-{i:04d}", "slow:0.01") for i in range(N)]
        shard = f"s3://{BUCKET}/run/shards/shard-00000.jsonl"
        storage.write_bytes(shard, b"".join(json.dumps(r).encode() + b"\n" for r in records))
        prefix = f"s3://{BUCKET}/run/results/shard-00000"

        async def stop_store_after_first_checkpoint() -> None:
            while not storage.list(prefix):
                await asyncio.sleep(0.02)
            stop_group(server.proc)

        stopper = asyncio.create_task(stop_store_after_first_checkpoint())
        retry_s = 3.0
        started = time.monotonic()
        with pytest.raises(CheckpointWriteFailed):
            await run_shard(storage, shard, prefix,
                            config(fault_server, concurrency=8, max_unflushed=50, checkpoint_retry_s=retry_s))
        failed_after = time.monotonic() - started
        await stopper
        # Bounded: the retry time plus one write's own timeouts, not the rest of the shard.
        assert failed_after < retry_s + 30, failed_after
        sent_in_first = set(fault_server.counts())
        assert len(sent_in_first) < N

        server = start_seaweedfs(data, "ckpt-key", "ckpt-secret", ports=server.ports)
        storage = S3Storage(client=server.client())
        outcome = await run_shard(storage, shard, prefix, config(fault_server, concurrency=8))
        results = results_by_id(storage, prefix, shard)  # fails on any id stored twice
        assert len(results) == N and all(r["error"] is None for r in results.values())
        assert outcome.failed == 0 and outcome.resumed + outcome.completed == N
        assert outcome.resumed > 0  # what was durable before the outage was not sent again
    finally:
        stop_group(server.proc)
