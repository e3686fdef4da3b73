"""A time bound on calls that may hang in the kernel (a shared volume's stuck NFS read).

Python cannot interrupt a blocked ``read(2)``: the only bound is to make the call in a
thread of its own and stop waiting for it. The call then still finishes (or never does)
in that thread; what it returns is dropped, and nothing it touches is shared with the
caller (a tier read returns a fresh ``bytes``; the slab is written only by the caller).

So that hung calls cannot pile up threads, the runner has a fixed number of them; a call
that times out leaves its thread counted as stuck until it returns, and while every
thread is stuck, or for ``retry_s`` after a timeout, calls fail at once: an outage costs
one timeout per ``retry_s``, not one per block (as the Redis tier does).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from kvcache.tiers.base import TierUnavailable

log = logging.getLogger(f"vllm.{__name__}")

T = TypeVar("T")
_Call = tuple[Future, Callable[..., object], tuple]


class DeadlineRunner:
    def __init__(self, name: str, timeout_s: float, retry_s: float, threads: int = 4) -> None:
        if timeout_s <= 0 or retry_s < 0 or threads < 1:
            raise ValueError(f"{name}: timeout_s must be > 0, retry_s >= 0, threads >= 1")
        self.name = name
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.threads = threads
        # Daemon threads, not a ThreadPoolExecutor: its exit hook joins every thread, and a
        # hung one would keep the process from exiting.
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        # Named per runner, so that its threads can be told from other runners' (tests count them).
        self.thread_prefix = f"kvcache-{name}-{id(self):x}-"
        for i in range(threads):
            threading.Thread(target=self._serve, name=f"{self.thread_prefix}{i}", daemon=True).start()
        self._lock = threading.Lock()
        self._stuck = 0
        self._down_until = 0.0
        self.timeouts = 0

    @property
    def stuck(self) -> int:
        """Calls that timed out and have not returned yet (each holds one thread)."""
        return self._stuck

    def run(self, what: str, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` within ``timeout_s``, else ``TierUnavailable`` naming ``what``."""
        with self._lock:
            if self._stuck >= self.threads:
                raise TierUnavailable(f"{self.name}: {self._stuck} calls still hung; not waiting for another")
            if time.monotonic() < self._down_until:
                raise TierUnavailable(f"{self.name}: marked down after a call took over {self.timeout_s}s")
        future: Future = Future()
        self._calls.put((future, fn, args))
        try:
            return future.result(self.timeout_s)
        except FutureTimeout:
            self._timed_out(future)
            raise TierUnavailable(
                f"{self.name}: {what} took over {self.timeout_s}s; counted as a miss"
            ) from None

    def _timed_out(self, future: Future) -> None:
        with self._lock:
            self._stuck += 1
            self.timeouts += 1
            self._down_until = time.monotonic() + self.retry_s
            first = self.timeouts == 1
        future.add_done_callback(self._returned)
        if first:
            log.warning("kvcache: a %s call took over %ss; the tier counts as down for %ss at a time",
                        self.name, self.timeout_s, self.retry_s)

    def _returned(self, _: Future) -> None:
        with self._lock:
            self._stuck -= 1

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who re-raises it
                future.set_exception(exc)

    def close(self) -> None:
        """Stop the threads once their calls return; never waits for a hung one."""
        for _ in range(self.threads):
            self._calls.put(None)
