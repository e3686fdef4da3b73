"""Progress lines with rate and ETA, written to the log at a steady interval.

With a deadline, each line also says whether the shard can finish in its window at the rate
it has measured so far; the first time it cannot, a warning says so (early, while something
can still be done: more capacity, a longer window), and ``at_risk`` is what the driver's
metrics report.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from aibrix_operators.batch.window_outlook import window_outlook

log = logging.getLogger("aibrix_operators.driver.progress")



class ProgressReporter:
    def __init__(self, name: str, total: int, interval_s: float, already_done: int = 0,
                 deadline: float | None = None, detail: Callable[[], str] | None = None) -> None:
        self.name = name
        self.total = total
        self.interval_s = interval_s
        self.already_done = already_done
        self.deadline = deadline
        self.detail = detail
        self.started = time.monotonic()
        self.at_risk = False
        self._warned = False

    def line(self, completed: int, failed: int) -> str:
        done = self.already_done + completed + failed
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = (completed + failed) / elapsed
        remaining = max(self.total - done, 0)
        eta = f"{remaining / rate:.0f}s" if rate > 0 else "?"
        pct = 100.0 * done / self.total if self.total else 100.0
        text = (
            f"{self.name}: {done}/{self.total} ({pct:.1f}%) completed={completed} failed={failed} "
            f"resumed={self.already_done} rate={rate:.1f} req/s eta={eta}"
        )
        self._judge_window(remaining, completed + failed, elapsed)
        if self.at_risk:
            text += " AT RISK: will not finish in the window at this rate"
        return text + (self.detail() if self.detail is not None else "")

    def _judge_window(self, remaining: int, answered: int, elapsed: float) -> None:
        outlook = None if self.deadline is None else window_outlook(
            remaining, answered, elapsed, self.deadline - time.time())
        self.at_risk = outlook is not None and outlook.at_risk
        if self.at_risk and not self._warned:
            self._warned = True
            log.warning("%s: %s: it will not finish in time unless throughput rises (more serving "
                        "capacity, or a longer completion_window)", self.name, outlook.line())

    def report(self, completed: int, failed: int, final: bool = False) -> None:
        log.info("%s%s", "done " if final else "", self.line(completed, failed))

    async def run(self, counts: Callable[[], tuple[int, int]]) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.report(*counts())
