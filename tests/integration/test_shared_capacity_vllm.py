"""Shared capacity mode against real vLLM CPU servers (issue 21).

``vllm_priority`` runs with ``--scheduling-policy priority`` and only 2 sequences at a time, so
a handful of requests saturates it. It reports its policy through serving/scheduling_policy.py's
middleware, as the serving images start it; the refusal against a first-come-first-served server
is test_shared_mode_refused_vllm.py (it does not need to run alone).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from aibrix_operators.capacity import controller as shared_capacity
from aibrix_operators.capacity import policy
from aibrix_operators.serving.local_vllm import VLLMServer
from tests.integration import priority_vllm
from tests.integration.priority_vllm import MAX_NUM_SEQS, completion

# Who is served first, and what the controller saw, depend on the server's load: alone, not beside
# another worker's vLLM (a burst under a second worker's load never filled vLLM's queue).
pytestmark = [pytest.mark.e2e, pytest.mark.serial]

BURST_AT_MOST_S = 20.0


@pytest.fixture(scope="module")
def vllm_priority(tiny_model: Path) -> Iterator[VLLMServer]:
    with VLLMServer(priority_vllm.priority_spec(tiny_model)) as server:
        yield server


async def _timed(session: aiohttp.ClientSession, url: str, body: dict, t0: float) -> tuple[int, float]:
    async with session.post(url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status, time.monotonic() - t0


async def _queue(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(running, waiting) requests, as the server reports them."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    count = {"vllm:num_requests_running{": 0.0, "vllm:num_requests_waiting{": 0.0}
    for line in text.splitlines():
        for name in count:
            if line.startswith(name):
                count[name] += float(line.rsplit(" ", 1)[1])
    return count["vllm:num_requests_running{"], count["vllm:num_requests_waiting{"]


async def test_online_requests_sent_later_are_served_before_waiting_batch_ones(
    vllm_priority: VLLMServer,
) -> None:
    url = vllm_priority.base_url
    async with aiohttp.ClientSession() as session:
        t0 = time.monotonic()
        # 512 tokens each: the first two run for seconds, so the queue below stays put while the
        # online requests are sent.
        batch = [asyncio.create_task(_timed(session, url, completion(f"batch {i}", 512, priority=10), t0))
                 for i in range(6)]
        # The online requests go once the server reports two batch requests running and four
        # waiting: a condition, not a clock (a fixed 0.3 s sleep found none queued yet beside
        # the nightly-eval training, 2026-12-05: the server had not admitted them by then).
        deadline = time.monotonic() + 60
        seen = await _queue(session, url)
        while seen != (MAX_NUM_SEQS, 6 - MAX_NUM_SEQS):
            assert time.monotonic() < deadline, f"(running, waiting) {seen}, want (2, 4), after 60 s"
            await asyncio.sleep(0.05)
            seen = await _queue(session, url)
        online = [asyncio.create_task(_timed(session, url, completion(f"online {i}", 4), t0))
                  for i in range(2)]
        batch_done = await asyncio.gather(*batch)
        online_done = await asyncio.gather(*online)
    assert all(status == 200 for status, _ in batch_done + online_done)
    finished = sorted(t for _, t in batch_done)
    # Both online requests were admitted ahead of the queued batch ones: they end before the
    # batch requests that were still waiting when they arrived (all but the first two).
    assert max(t for _, t in online_done) < finished[MAX_NUM_SEQS], (online_done, batch_done)


async def test_a_burst_holds_batch_back_and_every_batch_request_ends_answered_once(
    vllm_priority: VLLMServer, tmp_path: Path
) -> None:
    async def burst() -> tuple[list[int], list[tuple[float, int, str]], float | None]:
        await asyncio.sleep(1.0)
        # Held here, not looked up again at the end: a controller leaves the registry when its
        # shard ends.
        controllers = shared_capacity.REGISTRY.live()
        assert controllers, "the shard's controller should be live one second into the shard"
        statuses: list[int] = []
        held_at: float | None = None

        def history() -> list[tuple[float, int, str]]:
            return [entry for ctl in controllers for entry in ctl.history if entry[0] >= t0]

        async def client(i: int) -> None:  # closed loop: the next request as soon as one ends
            nonlocal held_at
            while time.monotonic() - t0 < BURST_AT_MOST_S:
                status, _ = await _timed(session, vllm_priority.base_url, completion(f"online {i}", 16), t0)
                statuses.append(status)
                if held_at is None and any(reason == policy.ONLINE_WAITING for _, _, reason in history()):
                    held_at = time.monotonic() - t0
                if held_at is not None and time.monotonic() - t0 > held_at + 1.0:
                    return  # held back for a second of the burst: enough

        # Eight clients against two sequences: six online requests queue at the server all the
        # burst long. The burst lasts until the controller has seen them (plus a second), at
        # most BURST_AT_MOST_S: how soon it does depends on when its scrapes land, and on a
        # loaded machine vLLM's gauges now and then read low for a few scrapes in a row.
        async with aiohttp.ClientSession() as session:
            t0 = time.monotonic()
            await asyncio.gather(*(client(i) for i in range(8)))
        return statuses, history(), held_at

    # 300 requests: long enough to outlast the longest burst (~10 batch req/s here when not held back).
    _, (online_statuses, history, held_at) = await priority_vllm.shard_beside(
        burst, vllm_priority.base_url, 300, tmp_path)
    assert online_statuses and set(online_statuses) == {200}
    # vLLM's own queue (its /metrics) told the controller online requests were waiting: it held
    # every batch request back (limit 0), and the batch finished after the burst.
    reasons = {reason for _, _, reason in history}
    assert held_at is not None, f"no online_waiting tick in a {BURST_AT_MOST_S:.0f} s burst: {reasons}"
    assert 0 in {limit for _, limit, _ in history}
