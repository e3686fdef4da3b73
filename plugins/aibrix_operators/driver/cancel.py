"""Cancel: a marker object the driver watches, the same way in a worker and in a pod.

Whoever cancels a batch (the Batch API, an operator) writes any object at the run's
cancel URI (``batch.job.cancel_marker_uri``). Each driver polls for it; once it is
there no request and no retry starts, requests in flight finish, and every request
not answered yet ends as a ``batch_cancelled`` error line, so the shard still
finishes with every id accounted for and merge can publish a ``cancelled`` batch.

A tripped stop rule (``driver/stop_watch.py``) stops the shard through the same watch: the same
flag the workers read, but the unanswered requests end as ``batch_stopped`` lines that name it.
"""

from __future__ import annotations

import asyncio
import logging

from aibrix_operators.batch.stop_rules import StopReason
from aibrix_operators.storage import Storage

log = logging.getLogger(__name__)


class CancelWatch:
    def __init__(self, storage: Storage, uri: str | None, poll_s: float) -> None:
        self.storage = storage
        self.uri = uri
        self.poll_s = poll_s
        self.requested = asyncio.Event()
        self.cancelled = False  # a plain attribute: workers read it before every attempt
        self.stopped_by: StopReason | None = None  # set when a stop rule, not a cancel, stopped it

    def stop(self, reason: StopReason) -> None:
        """Stop the shard for a tripped stop rule: no new request or attempt starts."""
        if self.requested.is_set():
            return
        log.warning("stopped by the batch's %s rule: %s; no new requests, unanswered ones end as "
                    "batch_stopped", reason.rule, reason.message)
        self.stopped_by = reason
        self.cancelled = True
        self.requested.set()

    async def check(self) -> bool:
        """Look for the marker once; True (and ``cancelled`` set) once it is there."""
        if self.uri is None or self.requested.is_set():
            return self.cancelled
        try:
            found = await asyncio.to_thread(self.storage.exists, self.uri)
        except Exception as exc:  # noqa: BLE001 - a store hiccup must not fail the shard
            log.warning("cannot check the cancel marker %s (%s); will look again", self.uri, exc)
            return False
        if found:
            log.warning("cancel requested (%s): no new requests; unanswered ones end as "
                        "batch_cancelled", self.uri)
            self.cancelled = True
            self.requested.set()
        return found

    async def run(self) -> None:
        while self.uri is not None and not await self.check():
            await asyncio.sleep(self.poll_s)
