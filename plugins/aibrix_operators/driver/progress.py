"""Progress lines with rate and ETA, written to the log at a steady interval."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger("aibrix_operators.driver.progress")


class ProgressReporter:
    def __init__(self, name: str, total: int, interval_s: float, already_done: int = 0) -> None:
        self.name = name
        self.total = total
        self.interval_s = interval_s
        self.already_done = already_done
        self.started = time.monotonic()

    def line(self, completed: int, failed: int) -> str:
        done = self.already_done + completed + failed
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = (completed + failed) / elapsed
        remaining = max(self.total - done, 0)
        eta = f"{remaining / rate:.0f}s" if rate > 0 else "?"
        pct = 100.0 * done / self.total if self.total else 100.0
        return (
            f"{self.name}: {done}/{self.total} ({pct:.1f}%) completed={completed} failed={failed} "
            f"resumed={self.already_done} rate={rate:.1f} req/s eta={eta}"
        )

    def report(self, completed: int, failed: int, final: bool = False) -> None:
        log.info("%s%s", "done " if final else "", self.line(completed, failed))

    async def run(self, counts: Callable[[], tuple[int, int]]) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.report(*counts())
