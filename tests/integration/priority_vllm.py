"""What the two test files against a priority-scheduled vLLM server share
(test_online_first_vllm.py, test_shared_capacity_vllm.py): the server's spec, the request body,
and the shared-mode shard a burst of online requests runs beside."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from aibrix_operators.capacity.mode import SharedCapacity
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.preflight import check_endpoint
from aibrix_operators.driver.runner import run_shard
from aibrix_operators.serving.local_vllm import VLLMServerSpec
from aibrix_operators.storage import LocalStorage
from tests.integration.conftest import SERVED_NAME

T = TypeVar("T")

# Two sequences at a time: a handful of requests fills the server.
MAX_NUM_SEQS = 2


def priority_spec(model: Path, online_first: bool = False) -> VLLMServerSpec:
    """``--scheduling-policy priority`` and MAX_NUM_SEQS slots; ``online_first`` adds the middleware."""
    return VLLMServerSpec(model=str(model), served_model_name=SERVED_NAME, scheduling_policy="priority",
                          online_first=online_first, compact_engine=True,
                          extra_args=["--max-num-seqs", str(MAX_NUM_SEQS)])


def completion(prompt: str, max_tokens: int, priority: int | None = None) -> dict:
    """A greedy completion of exactly ``max_tokens`` tokens; a batch request carries a priority."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    return body if priority is None else {**body, "priority": priority}


def write_batch_shard(path: Path, n: int) -> Path:
    """``n`` short completions with ids b000, b001, ...: the batch side of a burst test."""
    lines = [{"custom_id": f"b{i:03d}", "method": "POST", "url": "/v1/completions",
              "body": completion(f"batch item {i}", 16)} for i in range(n)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def shared_mode_config(endpoint: str) -> DriverConfig:
    """The driver in shared mode, aiming at the server's MAX_NUM_SEQS slots."""
    return DriverConfig(endpoint=endpoint, concurrency=8, deadline=time.time() + 600, api_key_env=None,
                        capacity=SharedCapacity(target_inflight=MAX_NUM_SEQS, tick_s=0.1))


def shard_results(results_dir: Path) -> list[dict]:
    """Every result line the driver wrote under ``results_dir``."""
    return [json.loads(line) for f in sorted(results_dir.rglob("*.jsonl"))
            for line in f.read_text().splitlines()]


async def shard_beside(
    burst: Callable[[], Awaitable[T]], endpoint: str, n: int, work: Path
) -> tuple[list[dict], T]:
    """Run a shared-mode shard of ``n`` batch requests while ``burst()`` sends online traffic.

    Asserts what every such test asserts first, that each batch request ended answered exactly
    once; returns the shard's result lines and what ``burst()`` returned.
    """
    shard = write_batch_shard(work / "shard.jsonl", n)
    config = shared_mode_config(endpoint)
    await check_endpoint(config, SERVED_NAME)  # the server reports priority scheduling: accepted
    burst_task = asyncio.create_task(burst())
    outcome = await run_shard(LocalStorage(), str(shard), str(work / "results"), config)
    burst_result = await burst_task
    assert (outcome.completed, outcome.failed) == (n, 0)
    results = shard_results(work / "results")
    assert sorted(r["custom_id"] for r in results) == [f"b{i:03d}" for i in range(n)]  # each once
    return results, burst_result
