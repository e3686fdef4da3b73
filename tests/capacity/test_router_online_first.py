"""The P/D router's online-first admission (router/admission.py), as its image runs it.

The router process (``python -m aibrix_operators.router --online-first N``) in front of a real
aiohttp decode stand-in that takes a while per request: with both classes queued, online
requests are forwarded first and queued batch ones are shed (429 ``batch_shed``); the batch
driver in shared mode sends the shed ones again, so every batch request ends answered.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest

from aibrix_operators.capacity.mode import SharedCapacity
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.runner import run_shard
from aibrix_operators.storage import LocalStorage
from tests.router.stub_backend import StubBackend
from tests.router.test_router_timeouts import RouterProcess

pytestmark = pytest.mark.service

ONLINE = {"model": "m", "prompt": "online", "max_tokens": 4}
BATCH = {**ONLINE, "prompt": "batch", "priority": 10}


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json(content_type=None)


@pytest.fixture
async def busy_decode():
    stub = await StubBackend("d0", delay_s=0.3, policy="priority").start()
    yield stub
    await stub.close()


async def test_online_requests_go_first_and_queued_batch_ones_are_shed(busy_decode: StubBackend) -> None:
    router = RouterProcess(busy_decode.url, "--online-first", "2", "--batch-wait-s", "10",
                           "--preempt-batch", "off")
    try:
        await router.wait_ready()
        async with aiohttp.ClientSession() as session:
            # Two batch requests take both slots; three more batch ones queue behind them.
            running = [asyncio.create_task(_post(session, router.url, {**BATCH, "prompt": f"b{i}"}))
                       for i in range(2)]
            await asyncio.sleep(0.1)
            queued = [asyncio.create_task(_post(session, router.url, {**BATCH, "prompt": f"q{i}"}))
                      for i in range(3)]
            await asyncio.sleep(0.05)
            online = [asyncio.create_task(_post(session, router.url, {**ONLINE, "prompt": f"o{i}"}))
                      for i in range(3)]
            shed = await asyncio.gather(*queued)
            assert all(status == 429 and body["error"]["code"] == "batch_shed" for status, body in shed), shed
            answers = await asyncio.gather(*running, *online)
            assert all(status == 200 for status, _ in answers), answers
            async with session.get(router.url + "/metrics") as r:
                page = await r.text()
            async with session.get(router.url + "/v1/models") as r:
                policy = r.headers.get("x-aibrix-scheduling-policy")
        # The instance saw the two running batch requests, then every online one; no shed one.
        prompts = [body["prompt"] for _, body in busy_decode.received]
        assert sorted(prompts[:2]) == ["b0", "b1"]
        assert sorted(prompts[2:]) == ["o0", "o1", "o2"]
        assert 'aibrix_router_shed_total{reason="online_waiting"} 3.0' in page
        assert policy == "priority"  # both the router and the instance order by priority
    finally:
        router.stop()


async def test_an_online_request_takes_a_forwarded_batch_requests_slot(busy_decode: StubBackend) -> None:
    busy_decode.delay_s = 2.0  # long batch generations
    router = RouterProcess(busy_decode.url, "--online-first", "2", "--batch-wait-s", "10")
    try:
        await router.wait_ready()
        async with aiohttp.ClientSession() as session:
            t0 = time.monotonic()
            running = [asyncio.create_task(_post(session, router.url, {**BATCH, "prompt": f"b{i}"}))
                       for i in range(2)]
            await asyncio.sleep(0.2)
            online = await asyncio.gather(*(_post(session, router.url, {**ONLINE, "prompt": f"o{i}"})
                                            for i in range(2)))
            online_s = time.monotonic() - t0
            taken = await asyncio.gather(*running)
            async with session.get(router.url + "/metrics") as r:
                page = await r.text()
    finally:
        router.stop()
    assert [s for s, _ in online] == [200, 200]
    assert online_s < 0.2 + 2 * 2.0  # they did not wait for the batch generations to end
    assert all(s == 429 and b["error"]["code"] == "batch_shed" and "preempted" in b["error"]["message"]
               for s, b in taken), taken
    assert 'aibrix_router_shed_total{reason="preempted"} 2.0' in page


async def test_a_batch_queue_is_served_in_turn_when_no_online_request_waits(busy_decode: StubBackend) -> None:
    router = RouterProcess(busy_decode.url, "--online-first", "1", "--batch-wait-s", "10")
    try:
        await router.wait_ready()
        async with aiohttp.ClientSession() as session:
            answers = await asyncio.gather(*(_post(session, router.url, {**BATCH, "prompt": f"b{i}"})
                                             for i in range(4)))
        assert [status for status, _ in answers] == [200] * 4  # waited, none shed
    finally:
        router.stop()


async def test_shed_batch_requests_end_answered_through_the_driver(
    busy_decode: StubBackend, tmp_path: Path
) -> None:
    busy_decode.delay_s = 0.05
    router = RouterProcess(busy_decode.url, "--online-first", "3", "--batch-wait-s", "0.2")
    shard = tmp_path / "shard.jsonl"
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": f"p{i}", "max_tokens": 4}} for i in range(60)]
    shard.write_text("".join(json.dumps(line) + "\n" for line in lines))
    try:
        await router.wait_ready()
        stop = asyncio.Event()

        async def online_load(session: aiohttp.ClientSession) -> int:
            sent = 0
            while not stop.is_set():
                status, _ = await _post(session, router.url, ONLINE)
                assert status == 200  # online requests are never shed
                sent += 1
            return sent

        config = DriverConfig(endpoint=router.url, concurrency=16, backoff_base_s=0.05, backoff_max_s=0.2,
                              deadline=time.time() + 120, api_key_env=None,
                              capacity=SharedCapacity(target_inflight=3, tick_s=0.1))
        async with aiohttp.ClientSession() as session:
            # Two online clients on three slots: online never fills the router, so batch requests
            # are shed only for waiting too long, and are never taken back.
            load = [asyncio.create_task(online_load(session)) for _ in range(2)]
            outcome = await run_shard(LocalStorage(), str(shard), str(tmp_path / "results"), config)
            stop.set()
            online_sent = sum(await asyncio.gather(*load))
            async with session.get(router.url + "/metrics") as r:
                page = await r.text()
    finally:
        router.stop()
    assert (outcome.completed, outcome.failed) == (60, 0)
    results = [json.loads(line) for f in sorted((tmp_path / "results").rglob("*.jsonl"))
               for line in f.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(f"r{i}" for i in range(60))  # each once
    assert all(r["error"] is None for r in results)
    shed = sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith("aibrix_router_shed_total"))
    assert shed > 0 and outcome.retries > 0  # the driver met shedding and sent the shed ones again
    assert outcome.outages == 0  # a 429 is the endpoint's "not now", not an outage
    assert online_sent > 0
    # Batch requests the instance saw carried the deployment's priority, so vLLM would order them too.
    batch_seen = [b for _, b in busy_decode.received if b["prompt"].startswith("p")]
    assert batch_seen and all(b["priority"] == 10 for b in batch_seen)
