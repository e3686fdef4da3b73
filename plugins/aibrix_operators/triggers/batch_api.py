"""``BatchApiTrigger``: waits in the triggerer for a Batch API batch to end.

The operator that submitted the batch defers to it, so a batch that runs for hours holds no
worker slot. It polls ``GET /v1/batches/{id}`` with backoff: every ``poll_interval_s`` at
first, each wait 1.5 times the last up to ``max_poll_interval_s`` (a long batch costs the API a
poll a minute, a short one is seen within seconds). An answer the service could not give
(connection refused, timeout, 5xx, 429) is the infrastructure's: it is logged and the trigger
polls again, however long that lasts; what the service refuses (401, 403, 404) ends the wait.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import openai
from airflow.triggers.base import BaseTrigger, TriggerEvent

from aibrix_operators.client.batch_client import TERMINAL
from aibrix_operators.hooks.batch_api import DEFAULT_CONN_ID, BatchApiHook

BACKOFF = 1.5
# The service did not answer; poll again. Anything else from it is an answer.
TRANSIENT = (openai.APIConnectionError, openai.InternalServerError, openai.RateLimitError)


class BatchApiTrigger(BaseTrigger):
    """Fires once: ``{"status": <terminal status>, "batch": <the batch object>}`` when the batch
    ends, ``{"status": "error", "message": …}`` when the service refuses to say, or
    ``{"status": "timeout", "batch": …}`` at ``end_by`` (epoch seconds) with the batch still
    running."""

    def __init__(self, batch_id: str, batch_conn_id: str = DEFAULT_CONN_ID, poll_interval_s: float = 5.0,
                 max_poll_interval_s: float = 60.0, end_by: float | None = None) -> None:
        super().__init__()
        self.batch_id = batch_id
        self.batch_conn_id = batch_conn_id
        self.poll_interval_s = poll_interval_s
        self.max_poll_interval_s = max_poll_interval_s
        self.end_by = end_by

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "batch_id": self.batch_id, "batch_conn_id": self.batch_conn_id,
            "poll_interval_s": self.poll_interval_s, "max_poll_interval_s": self.max_poll_interval_s,
            "end_by": self.end_by})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        client = await BatchApiHook(self.batch_conn_id).get_async_conn()
        wait = self.poll_interval_s
        last: dict[str, Any] | None = None
        try:
            while True:
                try:
                    batch = await client.batches.retrieve(self.batch_id)
                except TRANSIENT as exc:
                    self.log.warning("batch %s: the Batch API did not answer (%s); polling again in %.0fs",
                                     self.batch_id, type(exc).__name__, wait)
                except openai.APIStatusError as exc:
                    yield TriggerEvent({"status": "error", "batch_id": self.batch_id, "message": (
                        f"the Batch API refused to report batch {self.batch_id}: "
                        f"HTTP {exc.status_code} {exc.message}")})
                    return
                else:
                    last = batch.model_dump(mode="json")
                    if batch.status in TERMINAL:
                        yield TriggerEvent({"status": batch.status, "batch": last})
                        return
                    self.log.info("batch %s is %s (%s)", self.batch_id, batch.status, _counts(last))
                if self.end_by is not None and time.time() >= self.end_by:
                    yield TriggerEvent({"status": "timeout", "batch_id": self.batch_id, "batch": last})
                    return
                await asyncio.sleep(wait)
                wait = min(wait * BACKOFF, self.max_poll_interval_s)
        finally:
            await client.close()


def _counts(batch: dict[str, Any]) -> str:
    counts = batch.get("request_counts") or {}
    return f"{counts.get('completed', 0)} of {counts.get('total', 0)} done, {counts.get('failed', 0)} failed"
