"""One controller per endpoint in this process: reads the endpoint's load, sets the batch limit.

Shards register while they run (``async with controller_for(...)``); the first starts the
tick loop on its event loop and the last one out stops it. Every tick reads the endpoint's
``/metrics`` (vLLM's or the P/D router's), asks ``policy.decide`` for the new limit and applies
it to the shared ``AdaptiveLimiter``. Its state is what the Prometheus collector and the
shards' progress lines show.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from aibrix_operators.capacity.limiter import AdaptiveLimiter
from aibrix_operators.capacity.mode import SharedCapacity
from aibrix_operators.capacity.policy import ONLINE_WAITING, ControlLimits, Decision, decide
from aibrix_operators.capacity.signals import EndpointSignals, MetricsPage, parse_page, signals_between

log = logging.getLogger(__name__)

# Urgency (the growth step beside online traffic) is bounded both ways: a hopeless batch must
# not take the endpoint from the others, and a relaxed one still moves.
MIN_URGENCY, MAX_URGENCY = 0.25, 4.0
_SCRAPE_TIMEOUT_S = 2.0


@dataclass
class ShardDemand:
    """One registered shard: what it still has to send, and by when."""

    deadline: float  # Unix time; inf for none
    remaining: int
    started: float = field(default_factory=time.monotonic)
    done: int = 0

    def urgency(self, now: float) -> float:
        """Required rate over achieved rate: > 1 means behind schedule."""
        left = self.deadline - time.time()
        if left <= 0 or self.remaining <= 0:
            return MAX_URGENCY if self.remaining > 0 else MIN_URGENCY
        achieved = self.done / max(now - self.started, 1.0)
        required = self.remaining / left
        if achieved <= 0:
            return 1.0
        return min(MAX_URGENCY, max(MIN_URGENCY, required / achieved))


class EndpointController:
    def __init__(self, base_url: str, capacity: SharedCapacity, max_limit: int,
                 headers: dict[str, str] | None = None) -> None:
        self.base_url = base_url
        self.capacity = capacity
        self.limits = ControlLimits(
            max_limit=max_limit, target_inflight=capacity.target_inflight, max_waiting=capacity.max_waiting,
            batch_queue=capacity.batch_queue,
            max_kv_usage=capacity.max_kv_usage, ttft_target_s=capacity.ttft_target_s,
        )
        self.limiter = AdaptiveLimiter(1)  # slow start: an idle endpoint is filled in a few ticks
        self.headers = headers or {}
        self.shards: list[ShardDemand] = []
        self.backpressure = 0  # 429/503 answers since the last tick
        self.decision = Decision(1, "starting", 0.0)
        self.signals: EndpointSignals | None = None
        self.reasons: Counter[str] = Counter()  # ticks per decision reason
        self.ticks = 0
        # The last ticks as (monotonic time, limit, reason): for tests and the benchmark's timeline.
        self.history: deque[tuple[float, int, str]] = deque(maxlen=4096)
        self.scrape_failures = 0
        self._previous: MetricsPage | None = None
        self._task: asyncio.Task[None] | None = None

    # -- the driver's side -------------------------------------------------------------------
    def note_backpressure(self) -> None:
        self.backpressure += 1

    def register(self, deadline: float | None, remaining: int) -> ShardDemand:
        demand = ShardDemand(float("inf") if deadline is None else deadline, remaining)
        self.shards.append(demand)
        return demand

    def unregister(self, demand: ShardDemand) -> None:
        if demand in self.shards:
            self.shards.remove(demand)

    def describe(self) -> str:
        """For the progress line: the limit and why."""
        limiter = self.limiter
        return (f"shared: limit {limiter.limit} ({self.decision.reason}), in flight {limiter.in_flight}, "
                f"online ~{self.decision.online:.0f}")

    # -- the loop ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=_SCRAPE_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout, headers=self.headers) as session:
            while True:
                page = await self._scrape(session)
                self.tick(page)
                await asyncio.sleep(self.capacity.tick_s)

    async def _scrape(self, session: aiohttp.ClientSession) -> MetricsPage | None:
        try:
            async with session.get(self.base_url + "/metrics", allow_redirects=False) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                page = parse_page(await resp.text())
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.scrape_failures += 1
            if self.scrape_failures in (1, 10) or self.scrape_failures % 100 == 0:
                log.warning("cannot read %s/metrics (%s: %s); the batch limit follows 429/503 answers only",
                            self.base_url, type(exc).__name__, exc)
            return None
        return page if page.understood else None

    def tick(self, page: MetricsPage | None) -> Decision:
        """Apply one scrape (``None``: none was read) and the back-pressure seen since the last."""
        signals = signals_between(self._previous, page) if page is not None else None
        if page is not None:
            self._previous = page
        now = time.monotonic()
        urgency = max((s.urgency(now) for s in self.shards), default=1.0)
        decision = decide(self.limiter.limit, self.limits, signals, self.limiter.in_flight,
                          self.backpressure, urgency)
        self.backpressure = 0
        self.signals = signals
        self.decision = decision
        self.reasons[decision.reason] += 1
        self.ticks += 1
        self.history.append((now, decision.limit, decision.reason))
        self.limiter.set_limit(decision.limit)
        if decision.reason == ONLINE_WAITING and self.capacity.preempt_for_online:
            # Online requests wait at a full endpoint: the batch requests holding its sequence
            # slots would keep them to the end of their generation; take them back now.
            self.limiter.preempt(self.limiter.in_flight - decision.limit)
        return decision

    def state(self) -> dict[str, Any]:
        s = self.signals
        return {
            "limit": self.limiter.limit, "in_flight": self.limiter.in_flight, "waiting": self.limiter.waiting,
            "reason": self.decision.reason, "online": self.decision.online,
            "server_running": s.running if s else None, "server_waiting": s.waiting if s else None,
            "kv_usage": s.kv_usage if s else None, "ttft_s": s.ttft_s if s else None,
            "reasons": dict(self.reasons), "scrape_failures": self.scrape_failures,
            "preempted": self.limiter.preemptions,
        }


class _Registry:
    """Controllers by (event loop, endpoint): shards on one loop share one; a new loop (the next
    ``asyncio.run``) gets a fresh one, since a loop's tasks die with it."""

    def __init__(self) -> None:
        self._controllers: dict[tuple[int, str], tuple[EndpointController, int]] = {}

    def live(self) -> list[EndpointController]:
        return [c for c, _ in self._controllers.values()]

    def enter(self, base_url: str, capacity: SharedCapacity, max_limit: int,
              headers: dict[str, str]) -> EndpointController:
        key = (id(asyncio.get_running_loop()), base_url)
        entry = self._controllers.get(key)
        if entry is None:
            controller = EndpointController(base_url, capacity, max_limit, headers)
            controller.start()
            self._controllers[key] = (controller, 1)
            return controller
        controller, users = entry
        # The most any shard may send: several shards together never exceed the largest
        # concurrency one of them asked for (dedicated mode's bound).
        if max_limit > controller.limits.max_limit:
            controller.limits = replace(controller.limits, max_limit=max_limit)
        self._controllers[key] = (controller, users + 1)
        return controller

    async def leave(self, controller: EndpointController) -> None:
        key = next((k for k, (c, _) in self._controllers.items() if c is controller), None)
        if key is None:
            return
        _, users = self._controllers[key]
        if users > 1:
            self._controllers[key] = (controller, users - 1)
            return
        del self._controllers[key]
        await controller.stop()


REGISTRY = _Registry()


def join(base_url: str, capacity: SharedCapacity, max_limit: int, headers: dict[str, str],
         deadline: float | None, remaining: int) -> tuple[EndpointController, ShardDemand]:
    """The endpoint's controller for one shard (on the running loop), with the shard registered."""
    controller = REGISTRY.enter(base_url, capacity, max_limit, headers)
    return controller, controller.register(deadline, remaining)


async def leave(controller: EndpointController, demand: ShardDemand) -> None:
    controller.unregister(demand)
    await REGISTRY.leave(controller)
