"""Tell a sick endpoint from a sick request: the shard's circuit breaker.

A request that fails on its own (a 4xx, or a 5xx while the server answers
everyone else) ends as an error line after its bounded retries. When many
requests fail at once with transport errors, 5xx or garbled answers, the
endpoint is the problem: the breaker opens, every worker stops sending, and one
probe (the preflight's health check) polls the endpoint until it answers again.
Attempts that failed during an outage are not charged to their requests.

When a request has used its retries, :meth:`EndpointHealth.check` decides: if the
endpoint passes its health check, the failure is the request's own.

If the endpoint gives no successful answer for ``outage_budget_s``, the shard
fails with :class:`EndpointOutage` *without* checkpointing the unanswered
requests, so an Airflow retry (or a re-run of the driver) sends them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aibrix_operators.batch.error_codes import BatchFailure, CodedFailure

if TYPE_CHECKING:
    from aibrix_operators.driver.config import DriverConfig

log = logging.getLogger(__name__)


class EndpointOutage(CodedFailure):
    """The endpoint gave no answer for longer than the outage budget; nothing unanswered was recorded."""

    error_code, retryable = BatchFailure.ENDPOINT_UNAVAILABLE, True


class EndpointHealth:
    """Shared by a shard's workers; :meth:`run` is the probe loop (one task per shard)."""

    def __init__(self, probe: Callable[[], Awaitable[str | None]], config: DriverConfig) -> None:
        self._probe = probe
        # The breaker's settings are the shard's: breaker_failures, outage_budget_s, probe_interval_s.
        self.config = config
        # Successful answers so far: the probe loop restarts the outage clock when it grows.
        self.successes = 0
        self.outages = 0
        # The last request the endpoint answered, as (url, body): the probe replays it.
        self.canary: tuple[str, bytes] | None = None
        self.paused_s = 0.0
        self._streak = 0
        # A plain attribute (read before every attempt); _closed is what waiters wait on.
        self.is_open = False
        self._closed = asyncio.Event()
        self._closed.set()
        self._opened = asyncio.Event()
        self._opened_at = 0.0
        self._reason = ""
        self._check: asyncio.Future[str | None] | None = None

    def answered(self) -> None:
        """The endpoint handled a request (a success, or a rejection of the request itself)."""
        self.successes += 1
        self._streak = 0

    def failed(self, reason: str) -> None:
        """An infrastructure-looking failure (transport, 408/429, 5xx, garbled answer)."""
        self._streak += 1
        if self._streak >= self.config.breaker_failures:
            self.open(f"{self._streak} requests in a row failed, the last with {reason}")

    def open(self, reason: str) -> None:
        if self.is_open:
            return
        self.outages += 1
        self._opened_at = time.monotonic()
        self._reason = reason
        self.is_open = True
        self._closed.clear()
        self._opened.set()
        log.warning("endpoint %s looks unavailable (%s): pausing all requests and probing it",
                    self.config.base_url, reason)

    async def check(self) -> str | None:
        """Probe now (callers at the same moment share one probe); ``None`` when healthy."""
        if self._check is None or self._check.done():
            self._check = asyncio.ensure_future(self._probe())
        return await asyncio.shield(self._check)

    async def wait_closed(self, timeout_s: float | None) -> bool:
        """Wait until sending may go on; ``False`` when ``timeout_s`` passed first."""
        if self._closed.is_set():
            return True
        try:
            await asyncio.wait_for(self._closed.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def run(self) -> None:
        """Probe while the breaker is open; raise :class:`EndpointOutage` past the budget."""
        while True:
            await self._opened.wait()
            # The outage clock starts when the breaker opens and restarts whenever a request
            # in flight still gets an answer.
            since, answers = self._opened_at, self.successes
            while True:
                if self.successes != answers:
                    since, answers = time.monotonic(), self.successes
                silent_s = time.monotonic() - since
                if silent_s >= self.config.outage_budget_s:
                    raise EndpointOutage(
                        f"the inference endpoint {self.config.base_url} answered no request for "
                        f"{silent_s:.0f}s (outage budget {self.config.outage_budget_s:.0f}s; last failure: "
                        f"{self._reason}). Unanswered requests were not recorded: retrying the task "
                        "sends them once the endpoint is back"
                    )
                problem = await self.check()
                if problem is None:
                    break
                await asyncio.sleep(min(self.config.probe_interval_s, self.config.outage_budget_s - silent_s))
            paused = time.monotonic() - self._opened_at
            self.paused_s += paused
            self._streak = 0
            self._opened.clear()
            self.is_open = False
            self._closed.set()
            log.warning("endpoint %s answers its health check again after %.1fs: resuming",
                        self.config.base_url, paused)
