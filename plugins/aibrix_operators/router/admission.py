"""Online first: how many requests the router forwards at once, and who waits when it is full.

With ``--online-first N`` the router forwards at most N requests at a time. When it is full,
online requests queue ahead of batch ones and are never refused here; batch requests queue
behind them, and are *shed* — answered 429 with ``Retry-After`` — when an online request has
to wait, when the batch queue is full, or when they waited longer than ``--batch-wait-s``.
The batch driver waits out a 429 and sends the request again, never charging it to the
request (docs/shared-capacity.md), so shedding costs a batch time, not answers.

A request is batch when the deployment's class header says so (``--class-header``: the gateway
in front of the router sets it and overwrites what clients send), or, without one, when its
body's vLLM ``priority`` is above ``--online-priority`` (what the batch driver sends in shared
mode; online clients send none, which vLLM reads as 0).
"""

from __future__ import annotations

import asyncio
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
    ) -> None:
        self.max_inflight = max_inflight
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
        if self._has_room() and not self._queued(ONLINE) and (cls == ONLINE or not self._queued(BATCH)):
            self.inflight[cls] += 1
            return
        if cls == ONLINE:
            # Someone online has to wait: the batch requests queued behind are shed now, so the
            # drivers hear at once that the endpoint has no room for them.
            self._shed_queued_batch()
            fut = self._enqueue(ONLINE)
            self._preempt_one()
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

    def _preempt_one(self) -> None:
        while self._preemptible:
            ticket = self._preemptible.pop()  # the newest: the least work lost
            if not ticket.done():
                self.shed["preempted"] += 1
                ticket.set_result(None)
                return

    def release(self, cls: str) -> None:
        self.inflight[cls] -= 1
        self._wake()

    def _give_back(self, fut: asyncio.Future[None], cls: str) -> None:
        """A waiter that left: its permit, if it was granted one, goes to the next in line."""
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            self.release(cls)
        else:
            fut.cancel()

    def _has_room(self) -> bool:
        return self.inflight[ONLINE] + self.inflight[BATCH] < self.max_inflight

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
            while queue and self._has_room():
                fut = queue.popleft()
                if fut.done():
                    continue
                self.inflight[cls] += 1
                fut.set_result(None)
            if queue and not self._has_room():
                return
