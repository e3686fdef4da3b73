"""The endpoint controller against a real /metrics page and real 429 storms.

A real aiohttp server stands in for vLLM: it serves vLLM 0.32's metric names with values the
test sets, and answers completions (or 429s). The controller's own tick loop reads it over
HTTP; the driver runs shards through it.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from aibrix_operators.capacity import controller as shared_capacity
from aibrix_operators.capacity import policy
from aibrix_operators.capacity.mode import SharedCapacity
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.runner import run_shard
from aibrix_operators.storage import LocalStorage


class LoadedServer:
    """vLLM's /metrics names with settable values; completions after ``delay_s``."""

    def __init__(self) -> None:
        self.running = 0.0
        self.waiting = 0.0
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.storm = 0  # answer this many POSTs with 429 first
        self.delay_s = 0.01
        self.in_flight = 0
        self.max_in_flight = 0
        self.aborted = 0  # POSTs whose client went away before the answer (vLLM aborts those)
        self.server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    async def start(self) -> LoadedServer:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._post)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return self

    async def _metrics(self, request: web.Request) -> web.Response:
        labels = '{engine="0",model_name="m"}'
        return web.Response(text=(
            f"vllm:num_requests_running{labels} {self.running + self.in_flight}\n"
            f"vllm:num_requests_waiting{labels} {self.waiting}\n"
            f"vllm:kv_cache_usage_perc{labels} 0.1\n"
            f"vllm:time_to_first_token_seconds_sum{labels} {self.ttft_sum}\n"
            f"vllm:time_to_first_token_seconds_count{labels} {self.ttft_count}\n"
        ))

    async def _post(self, request: web.Request) -> web.Response:
        await request.read()
        if self.storm > 0:
            self.storm -= 1
            return web.json_response({"error": {"message": "busy", "code": "rate_limited"}}, status=429)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        finally:
            self.in_flight -= 1
        return web.json_response({"id": "c", "object": "text_completion", "choices": [{"text": "x"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1}})


@pytest.fixture
async def server():
    s = await LoadedServer().start()
    yield s
    await s.server.close()


def _write_shard(tmp_path: Path, requests: int) -> Path:
    """tmp_path/shard.jsonl: that many completion requests, r0, r1, ..."""
    lines = ({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": "p"}} for i in range(requests))  # fmt: skip
    shard = tmp_path / "shard.jsonl"
    shard.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return shard


async def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_limit_drops_on_online_queueing_and_rising_ttft_and_grows_back(server: LoadedServer) -> None:
    capacity = SharedCapacity(target_inflight=32, ttft_target_s=0.5, tick_s=0.05, batch_queue=2)
    ctl, demand = shared_capacity.join(server.url, capacity, 64, {}, None, 1000)
    try:
        await _until(lambda: ctl.limiter.limit == 34)  # idle: the target and a queue of 2 at once
        server.running, server.waiting = 30.0, 4.0  # an online burst fills the endpoint and queues
        await _until(lambda: ctl.limiter.limit == 0)
        assert ctl.decision.reason == policy.ONLINE_WAITING
        server.running, server.waiting = 20.0, 0.0  # the burst ebbs: 20 online requests still run
        await _until(lambda: ctl.limiter.limit == 14)  # 32 - 20, and a queue of 2: no more
        server.running = 4.0
        for _ in range(3):  # the recent TTFT climbs over the target: cut, again and again
            server.ttft_sum += 10 * 0.9
            server.ttft_count += 10
            await asyncio.sleep(0.08)
        assert policy.TTFT in {reason for _, _, reason in ctl.history}
        limit_under_ttft = ctl.limiter.limit
        server.running = 0.0
        await _until(lambda: ctl.limiter.limit == 34)  # grows back once the endpoint is idle
        assert limit_under_ttft < 28
    finally:
        await shared_capacity.leave(ctl, demand)
    assert shared_capacity.REGISTRY.live() == []  # the last shard out stops the loop


async def test_a_429_storm_halves_the_limit_and_every_request_still_ends_answered(
    server: LoadedServer, tmp_path: Path
) -> None:
    shard = _write_shard(tmp_path, 400)
    server.storm = 150
    server.delay_s = 0.02
    config = DriverConfig(endpoint=server.url, concurrency=32, backoff_base_s=0.01, backoff_max_s=0.05,
                          deadline=time.time() + 120, api_key_env=None,
                          capacity=SharedCapacity(target_inflight=32, tick_s=0.05))
    seen: list[tuple[float, int, str]] = []

    async def watch() -> None:
        while True:
            for ctl in shared_capacity.REGISTRY.live():
                seen.extend(ctl.history)
                ctl.history.clear()
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    try:
        outcome = await run_shard(LocalStorage(), str(shard), str(tmp_path / "results"), config)
    finally:
        watcher.cancel()
    assert (outcome.completed, outcome.failed) == (400, 0)  # 429s are waited out, never charged
    limits = [limit for _, limit, _ in seen]
    reasons = [reason for _, _, reason in seen]
    assert policy.BACKPRESSURE in reasons
    first_backoff = reasons.index(policy.BACKPRESSURE)
    assert min(limits[first_backoff:]) <= 8  # halved, tick after tick, while the storm lasted
    assert max(limits[first_backoff:]) >= 16  # and grew back once it ended
    assert server.max_in_flight <= 32  # never more than dedicated mode's concurrency


async def test_a_burst_that_fills_the_endpoint_takes_batch_requests_back_and_they_end_answered(
    server: LoadedServer, tmp_path: Path
) -> None:
    shard = _write_shard(tmp_path, 40)
    server.delay_s = 0.5  # long generations: without preemption they would hold their slots
    config = DriverConfig(endpoint=server.url, concurrency=8, deadline=time.time() + 120, api_key_env=None,
                          capacity=SharedCapacity(target_inflight=8, batch_queue=0, tick_s=0.05))

    async def burst() -> int:
        await _until(lambda: server.in_flight >= 4)
        server.running, server.waiting = 8.0, 3.0  # online fills the endpoint and queues
        await _until(lambda: server.in_flight == 0, 5)  # every batch request withdrawn
        taken = server.aborted
        await asyncio.sleep(0.3)
        server.running, server.waiting = 0.0, 0.0
        return taken

    burst_task = asyncio.create_task(burst())
    outcome = await run_shard(LocalStorage(), str(shard), str(tmp_path / "results"), config)
    taken = await burst_task
    assert taken >= 4  # the server saw them go away mid-answer
    assert (outcome.completed, outcome.failed) == (40, 0)
    results = [json.loads(line) for f in sorted((tmp_path / "results").rglob("*.jsonl"))
               for line in f.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(f"r{i}" for i in range(40))  # each once
    assert outcome.outages == 0  # withdrawn attempts are not endpoint failures


async def test_a_shard_cancelled_while_its_attempts_are_withdrawn_still_ends(
    server: LoadedServer, tmp_path: Path
) -> None:
    """A withdrawal cancels the sender's own task and takes back only its own cancel: a cancel
    from whoever runs the shard, arriving with it, still ends the shard."""
    shard = _write_shard(tmp_path, 20)
    server.delay_s = 5.0
    config = DriverConfig(endpoint=server.url, concurrency=4, deadline=time.time() + 120, api_key_env=None,
                          capacity=SharedCapacity(target_inflight=4, batch_queue=0, tick_s=3600))
    run = asyncio.create_task(run_shard(LocalStorage(), str(shard), str(tmp_path / "results"), config))
    await _until(lambda: server.in_flight == 4)
    (controller,) = shared_capacity.REGISTRY.live()
    run.cancel()
    await asyncio.sleep(0)  # the shard's task group has cancelled its senders; they have not run yet
    assert controller.limiter.preempt(4) == 4  # so each sender meets both cancels at once
    t0 = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(run), 3)
    assert time.monotonic() - t0 < 3 and run.cancelled()
