"""Asynchronous write-behind into L2.

The forward pass only enqueues; one background thread encodes and writes. The queue is
bounded: when L2 is slower than the engine, writes are dropped (and counted) rather than
ever blocking compute or growing memory without bound. L1 has the data meanwhile.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import torch

from kvcache import codec, metrics
from kvcache.tiers.base import L2Store, TierUnavailable

# Under "vllm." so that records reach the handlers vLLM configures in its processes.
log = logging.getLogger(f"vllm.{__name__}")

_STOP = object()


class L2Writer:
    def __init__(self, store: L2Store, max_queue: int = 4096, mac: codec.Mac | None = None) -> None:
        self.store = store
        self.mac = mac  # tags every record (computed here, off the forward pass)
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="kvcache-l2-writer", daemon=True)
        self._thread.start()
        self.written = 0
        self.failed = 0
        self.dropped = 0

    def submit(
        self, key: str, tensor: torch.Tensor, crc: int | None, release: Callable[[], None] | None = None
    ) -> bool:
        """Queue one record (crc None: computed here); False (and counted) when the queue is full.

        ``release`` runs once ``tensor`` is no longer needed (encoded, or dropped): the
        worker uses it to free the L1 slot the tensor lives in.
        """
        try:
            self._queue.put_nowait((key, tensor, crc, release))
            return True
        except queue.Full:
            self.dropped += 1
            metrics.L2_DROPPED.inc()
            if release is not None:
                release()
            return False

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything queued so far is written (or failed). For tests and benches."""
        done = threading.Event()
        try:
            self._queue.put((None, done, 0, None), timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            key, tensor, crc, release = item
            if key is None:
                tensor.set()  # a flush marker
                continue
            try:
                try:
                    record = codec.encode(key, tensor, crc, self.mac)
                finally:
                    if release is not None:
                        release()
                self.store.put(key, record)
                self.written += 1
                metrics.BYTES_SAVED.labels(self.store.name).inc(len(record))
            except TierUnavailable:
                self.failed += 1
                metrics.L2_ERRORS.labels("put").inc()
            except Exception:  # never let the writer thread die: later writes must still go
                self.failed += 1
                metrics.L2_ERRORS.labels("put").inc()
                log.exception("kvcache: L2 write of %s failed", key)
