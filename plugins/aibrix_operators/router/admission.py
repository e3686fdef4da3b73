"""Online first: how many requests the router forwards at once, and who waits when it is full.

With ``--online-first N`` the router forwards at most N requests at a time. When it is full,
online requests queue ahead of batch ones and are never refused here; batch requests queue
behind them, and are *shed* — answered 429 with ``Retry-After`` — when an online request has
to wait, when the batch queue is full, or when they waited longer than ``--batch-wait-s``.
The batch driver waits out a 429 and sends the request again, never charging it to the
request (docs/shared-capacity.md), so shedding costs a batch time, not answers.

**A reserve for online traffic** (``--online-reserve R``, ``--online-quiet-s Q``): while online
traffic is recent — an online request in flight or waiting, or one within the last Q seconds —
batch requests hold at most N - R slots (fewer when more online ones run). An online request that
arrives withdraws the newest forwarded batch requests over that cap at once, not at anyone's next
tick, and the cap lifts Q seconds after the last online request ends. On a compute-bound engine
(a CPU, a small model) every batch sequence in a step slows the online one's step, so R = N keeps
online steps to themselves while it is recent; on a GPU, where a decode step's cost barely grows
with its batch, a small R covers an online burst's first requests (docs/shared-capacity.md).

A request is batch when the deployment's class header says so (``--class-header``: the gateway
in front of the router sets it and overwrites what clients send), or, without one, when its
body's vLLM ``priority`` is above ``--online-priority`` (what the batch driver sends in shared
mode; online clients send none, which vLLM reads as 0).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from typing import Any

ONLINE, BATCH = "online", "batch"


class Shed(Exception):
    """A batch request the router will not forward now; answered 429, retried by the driver."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Admission:
    def __init__(
        self, max_inflight: int, *, batch_queue: int = 256, batch_wait_s: float = 5.0,
        online_priority: int = 0, class_header: str | None = None, preempt_batch: bool = True,
        online_reserve: int = 0, online_quiet_s: float = 1.0,
    ) -> None:
        if not 0 <= online_reserve <= max_inflight:
            raise ValueError(f"online_reserve must be between 0 and the {max_inflight} slots, "
                             f"not {online_reserve}")
        if online_quiet_s < 0:
            raise ValueError(f"online_quiet_s must be 0 or more, not {online_quiet_s}")
        self.max_inflight = max_inflight
        self.online_reserve = online_reserve
        self.online_quiet_s = online_quiet_s
        self._online_seen = -math.inf  # when an online request last arrived or ended (monotonic)
        self.batch_queue = batch_queue
        self.batch_wait_s = batch_wait_s
        self.online_priority = online_priority
        self.class_header = class_header
        self.inflight = {ONLINE: 0, BATCH: 0}
        self._queues: dict[str, deque[asyncio.Future[None]]] = {ONLINE: deque(), BATCH: deque()}
        self.shed = {"online_waiting": 0, "queue_full": 0, "waited_too_long": 0, "preempted": 0}
        # Forwarded batch requests that may be taken back for a waiting online one (newest last):
        # the upstream call is cancelled, so vLLM aborts it and its sequence slot frees at once.
        self.preempt_batch = preempt_batch
        self._preemptible: list[asyncio.Future[None]] = []
        # Taken back and not yet ended: they still count in inflight[BATCH] until released.
        self._withdrawn: set[asyncio.Future[None]] = set()

    def classify(self, headers: Any, body: dict[str, Any]) -> str:
        if self.class_header is not None:
            return BATCH if str(headers.get(self.class_header, "")).strip().lower() == BATCH else ONLINE
        priority = body.get("priority")
        is_int = isinstance(priority, int) and not isinstance(priority, bool)
        return BATCH if is_int and priority > self.online_priority else ONLINE

    def waiting(self, cls: str) -> int:
        return sum(1 for f in self._queues[cls] if not f.done())

    async def admit(self, cls: str) -> None:
        """Return when the request may go; raises ``Shed`` for a batch request that may not."""
        if cls == ONLINE:
            self._online_seen = time.monotonic()
        if self._room_for(cls) and not self._queued(ONLINE) and (cls == ONLINE or not self._queued(BATCH)):
            self.inflight[cls] += 1
            if cls == ONLINE and self.online_reserve:
                self._withdraw_over_cap()
            return
        if cls == ONLINE:
            # Someone online has to wait: the batch requests queued behind are shed now, so the
            # drivers hear at once that the endpoint has no room for them.
            self._shed_queued_batch()
            fut = self._enqueue(ONLINE)
            self._preempt_one()
            if self.online_reserve:
                self._withdraw_over_cap()
            try:
                await fut
            except asyncio.CancelledError:
                self._give_back(fut, ONLINE)
                raise
            return
        if len(self._queues[BATCH]) >= self.batch_queue:
            self.shed["queue_full"] += 1
            raise Shed("queue_full")
        fut = self._enqueue(BATCH)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.batch_wait_s)
        except asyncio.CancelledError:  # the client went away while queued
            self._give_back(fut, BATCH)
            raise
        except TimeoutError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                return  # admitted at the last moment
            fut.cancel()
            self.shed["waited_too_long"] += 1
            raise Shed("waited_too_long") from None
        exc = fut.exception()
        if exc is not None:
            raise exc

    def preemption_ticket(self) -> asyncio.Future[None]:
        """For a forwarded batch request: resolves when an online request needs its slot."""
        ticket: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.preempt_batch:
            self._preemptible.append(ticket)
        return ticket

    def drop_ticket(self, ticket: asyncio.Future[None]) -> None:
        if ticket in self._preemptible:
            self._preemptible.remove(ticket)
        self._withdrawn.discard(ticket)

    def _preempt_one(self) -> bool:
        while self._preemptible:
            ticket = self._preemptible.pop()  # the newest: the least work lost
            if not ticket.done():
                self.shed["preempted"] += 1
                self._withdrawn.add(ticket)
                ticket.set_result(None)
                return True
        return False

    def _online_recent(self) -> bool:
        return (self.inflight[ONLINE] > 0 or self._queued(ONLINE)
                or time.monotonic() - self._online_seen < self.online_quiet_s)

    def batch_cap(self) -> int:
        """The slots batch requests may hold now: what online ones leave, and while online traffic is
        recent, not the reserve."""
        online = self.inflight[ONLINE]
        if self.online_reserve and self._online_recent():
            online = max(online, self.online_reserve)
        return self.max_inflight - online

    def _withdraw_over_cap(self) -> None:
        """Take back the newest forwarded batch requests over the cap (an online one just came)."""
        while self.inflight[BATCH] - len(self._withdrawn) > self.batch_cap() and self._preempt_one():
            pass

    def release(self, cls: str) -> None:
        self.inflight[cls] -= 1
        if cls == ONLINE and self.online_reserve:
            self._online_seen = time.monotonic()
            # The cap lifts once online traffic has been quiet that long: wake the batch queue then.
            asyncio.get_running_loop().call_later(self.online_quiet_s + 0.001, self._wake)
        self._wake()

    def _give_back(self, fut: asyncio.Future[None], cls: str) -> None:
        """A waiter that left: its permit, if it was granted one, goes to the next in line."""
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            self.release(cls)
        else:
            fut.cancel()

    def _has_room(self) -> bool:
        return self.inflight[ONLINE] + self.inflight[BATCH] < self.max_inflight

    def _room_for(self, cls: str) -> bool:
        return self._has_room() and (cls == ONLINE or not self.online_reserve
                                     or self.inflight[BATCH] < self.batch_cap())

    def _queued(self, cls: str) -> bool:
        queue = self._queues[cls]
        while queue and queue[0].done():
            queue.popleft()
        return bool(queue)

    def _enqueue(self, cls: str) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues[cls].append(fut)
        return fut

    def _shed_queued_batch(self) -> None:
        queue = self._queues[BATCH]
        while queue:
            fut = queue.popleft()
            if not fut.done():
                self.shed["online_waiting"] += 1
                fut.set_exception(Shed("online_waiting"))

    def _wake(self) -> None:
        for cls in (ONLINE, BATCH):
            queue = self._queues[cls]
            while queue and self._room_for(cls):
                fut = queue.popleft()
                if fut.done():
                    continue
                self.inflight[cls] += 1
                fut.set_result(None)
            if queue and not self._room_for(cls):
                return
