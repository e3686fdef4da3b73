"""Make a shard's results durable: the flush loop, with retries and back-pressure.

A segment leaves memory only once its write succeeded. A failed write is retried
with backoff, with the same name and bytes (a write that did land is simply
replaced by identical content); a store that stays down for ``retry_timeout_s``
fails the shard with :class:`CheckpointWriteFailed`. While writes fail, workers
stop taking new requests once ``max_unflushed`` results wait in memory, so an
outage of the store costs a bounded amount of memory and re-sent work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import KW_ONLY, dataclass, field

from aibrix_operators.batch.error_codes import BatchFailure, CodedFailure
from aibrix_operators.batch.shard_results import ResultLog
from aibrix_operators.driver.retry import backoff_delay

log = logging.getLogger(__name__)


class CheckpointWriteFailed(CodedFailure):
    """Results could not be made durable in time; unrecorded requests are sent again on retry."""

    error_code, retryable = BatchFailure.STORAGE_ERROR, True


@dataclass(eq=False)
class CheckpointWriter:
    log: ResultLog
    _: KW_ONLY
    retry_timeout_s: float
    max_unflushed: int
    backoff_base_s: float = 0.2
    backoff_max_s: float = 5.0
    write_retries: int = field(default=0, init=False)
    _stop: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _room: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def __post_init__(self) -> None:
        self._room.set()

    async def wait_for_room(self) -> None:
        """Called by a worker before it takes a request: blocks while the backlog is full."""
        while self.log.buffered() >= self.max_unflushed:
            self._room.clear()
            await self._room.wait()

    async def flush_what_is_left(self) -> None:
        """After a failure, keep the answers already in memory, so the retry re-sends less."""
        try:
            await asyncio.wait_for(asyncio.to_thread(self.log.flush), timeout=30)
        except Exception as exc:  # noqa: BLE001 - the shard is failing anyway; say what is lost
            log.warning("could not write %d buffered answers after the failure (%s); they will be re-sent",
                        self.log.buffered(), exc)

    def close(self) -> None:
        """No more results will come: write what is left and return from :meth:`run`."""
        self._stop.set()

    async def run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            if stopping or self.log.due() or self.log.buffered() >= self.max_unflushed:
                segment = self.log.take_segment()
                if segment is not None:
                    await self._write(*segment)
                self._room.set()
            if stopping and not self.log.buffered():
                return
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=min(0.2, self.log.flush_interval_s))
            except TimeoutError:
                pass

    async def _write(self, uri: str, data: bytes) -> None:
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                await asyncio.to_thread(self.log.storage.write_bytes, uri, data)
                if attempt:
                    log.warning("checkpoint %s written after %d retries (%.1fs)", uri, attempt,
                                time.monotonic() - started)
                return
            except Exception as exc:  # noqa: BLE001 - any store error gets the same bounded retry
                attempt += 1
                self.write_retries += 1
                waited = time.monotonic() - started
                if waited >= self.retry_timeout_s:
                    lines = data.count(b"\n")
                    raise CheckpointWriteFailed(
                        f"cannot write the checkpoint {uri} for {waited:.0f}s ({type(exc).__name__}: "
                        f"{exc}); the {lines} answers in it and those still in memory are not durable "
                        "and will be sent again when the task is retried"
                    ) from exc
                if attempt == 1:
                    log.warning("checkpoint write to %s failed (%s: %s); retrying for up to %.0fs",
                                uri, type(exc).__name__, exc, self.retry_timeout_s)
                delay = backoff_delay(attempt, self.backoff_base_s, self.backoff_max_s)
                await asyncio.sleep(min(delay, max(self.retry_timeout_s - waited, 0.0)))
