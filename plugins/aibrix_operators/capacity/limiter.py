"""Permits to send one batch request, with a limit that changes while requests are out, and
the earliest deadline served first.

Every shard of every batch in this process that sends to one endpoint takes its permits here
(several shards must not each believe they own the headroom). When the limit drops, requests
already out finish (they cannot be taken back) and no new one starts until the count is
under the new limit. Waiters are served by deadline (then arrival), so when capacity is short
the batch whose window closes first gets it, and a relaxed batch still gets every permit
nobody more urgent is waiting for.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import Any


class AdaptiveLimiter:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        # Attempts holding a permit, so a burst can take them back (``preempt``).
        self._attempts: set[asyncio.Future[Any]] = set()
        self._preempted: set[asyncio.Future[Any]] = set()
        self.preemptions = 0
        self._waiters: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, fut in self._waiters if not fut.done())

    def earliest_waiting_deadline(self) -> float | None:
        for deadline, _, fut in sorted(self._waiters):
            if not fut.done():
                return deadline
        return None

    def try_acquire(self) -> bool:
        """A permit now, if one is free and nobody is queued for it (the common, cheap case)."""
        if self.in_flight < self.limit and not self._waiters:
            self.in_flight += 1
            return True
        return False

    async def acquire(self, deadline: float) -> None:
        """Wait for a permit; ``deadline`` (Unix time, ``inf`` for none) orders the waiters."""
        if self.try_acquire():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (deadline, next(self._order), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted and cancelled at once: hand the permit on
            raise

    def release(self) -> None:
        self.in_flight -= 1
        self._wake()

    def track(self, attempt: asyncio.Future[Any]) -> None:
        self._attempts.add(attempt)

    def untrack(self, attempt: asyncio.Future[Any]) -> bool:
        """Forget a finished attempt; ``True`` when it ended because ``preempt`` took it back."""
        self._attempts.discard(attempt)
        if attempt in self._preempted:
            self._preempted.discard(attempt)
            return True
        return False

    def preempt(self, count: int) -> int:
        """Cancel up to ``count`` attempts in flight (vLLM aborts a request whose client goes
        away, so its sequence slot frees at once); their senders send them again later."""
        taken = 0
        for attempt in list(self._attempts):
            if taken >= count:
                break
            # Once each: an attempt is the sender's own task, and a second cancel would read as
            # somebody else's (a shutdown), not as this withdrawal.
            if not attempt.done() and attempt not in self._preempted:
                self._preempted.add(attempt)
                attempt.cancel()
                taken += 1
        self.preemptions += taken
        return taken

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.in_flight < self.limit:
            _, _, fut = heapq.heappop(self._waiters)
            if fut.done():  # its waiter was cancelled
                continue
            self.in_flight += 1
            fut.set_result(None)
