"""Progress for people: a batch's counts with rate and ETA, byte transfers with a bar.

Pure formatting plus two small helpers; the CLI decides where (stderr) and when (a TTY).
"""

from __future__ import annotations

import io
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from aibrix_operators.batch.lifecycle import BatchStatus
from aibrix_operators.batch_api import extensions

BAR_WIDTH = 24


def format_duration(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds) or math.isinf(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def bar(fraction: float, width: int = BAR_WIDTH) -> str:
    fraction = min(max(fraction, 0.0), 1.0)
    filled = int(fraction * width)
    return "[" + "#" * filled + "." * (width - filled) + "]"


class RateMeter:
    """Requests per second from what this client has seen, not the server's clock (which may
    be skewed); over a sliding window so a stall or a burst shows within a minute."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self.samples: list[tuple[float, int]] = []

    def observe(self, done: int, at: float | None = None) -> None:
        at = self.clock() if at is None else at
        if self.samples and done < self.samples[-1][1]:
            self.samples.clear()  # counts went back (a retried shard recounted): start over
        self.samples.append((at, done))
        while len(self.samples) > 2 and at - self.samples[1][0] >= self.window_s:
            self.samples.pop(0)

    def rate(self) -> float | None:
        if len(self.samples) < 2:
            return None
        (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
        return (d1 - d0) / (t1 - t0) if t1 > t0 else None

    def eta(self, total: int) -> float | None:
        rate = self.rate()
        if not self.samples:
            return None
        left = total - self.samples[-1][1]
        if left <= 0:
            return 0.0
        return left / rate if rate else None


@dataclass(frozen=True)
class RequestTally:
    """A batch's ``request_counts`` as a person should read them.

    For a batch a cancel or its window's end cut short, the API's ``failed`` holds, besides the
    requests that failed, every request left unanswered (never sent, or sent and cut off: its
    error line has code ``batch_cancelled`` / ``batch_expired``). Then ``cut_off_by`` names the
    cause and the batch counts as ``completed`` of ``total`` done, never as a mass failure and
    never as 100% done. Once the batch is finalized the server says how many were left
    unanswered (the extension field ``aibrix_unanswered``), and the two are shown apart
    ("134 not answered (cancelled), 2 failed"); before that, while cancelling, as "cancelled or failed"."""

    total: int
    completed: int
    failed: int
    cut_off_by: str | None = None  # "cancelled" / "expired"
    unanswered: int | None = None  # of failed, left unanswered by the cut-off; None: not known yet

    @property
    def done(self) -> int:
        return self.completed if self.cut_off_by else self.completed + self.failed

    def failed_words(self) -> str:
        if not self.cut_off_by:
            return f"{self.failed} failed"
        if self.unanswered is None:
            return f"{self.failed} {self.cut_off_by} or failed"
        words = [f"{self.unanswered} not answered ({self.cut_off_by})"] if self.unanswered else []
        if self.failed - self.unanswered:
            words.append(f"{self.failed - self.unanswered} failed")
        return ", ".join(words)


def request_tally(batch: Any, now: float | None = None) -> RequestTally:
    counts = batch.request_counts
    total, completed, failed = (counts.total, counts.completed, counts.failed) if counts else (0, 0, 0)
    status = str(batch.status)
    cut_off_by = None
    if status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
        cut_off_by = "cancelled"
    elif status == BatchStatus.EXPIRED:
        cut_off_by = "expired"
    elif status in (BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING) and getattr(batch, "expires_at", None):
        # Past its window the run writes batch_expired lines before the status says expired.
        if (time.time() if now is None else now) >= batch.expires_at:
            cut_off_by = "expired"
    unanswered = (getattr(batch, "model_extra", None) or {}).get(extensions.UNANSWERED)
    if not (isinstance(unanswered, int) and 0 <= unanswered <= failed) or not cut_off_by:
        unanswered = None
    return RequestTally(total, completed, failed, cut_off_by, unanswered)


def batch_progress(batch: Any, meter: RateMeter | None = None, now: float | None = None) -> str:
    """``batch_… in_progress [#####....] 412/1000 41% 12.3 req/s ETA 48s, 3 failed``; a batch
    cut short: ``batch_… cancelled [###.....] 64/200 completed 32%, 136 cancelled or failed``."""
    tally = request_tally(batch, now)
    total, done = tally.total, tally.done
    parts = [batch.id, f"{batch.status:<11}"]
    if total:
        parts += [bar(done / total), f"{done}/{total}" + (" completed" if tally.cut_off_by else ""),
                  f"{100 * done // total}%"]
        if meter is not None:
            rate = meter.rate()
            if rate is not None:
                parts.append(f"{rate:.1f} req/s")
            if batch.status in (BatchStatus.IN_PROGRESS, BatchStatus.VALIDATING) and done < total \
                    and not tally.cut_off_by:
                parts.append(f"ETA {format_duration(meter.eta(total))}")
    line = "  ".join(parts)
    return line + (f", {tally.failed_words()}" if tally.failed else "")


class TransferBar:
    """A byte-transfer bar on a TTY, redrawn at most 10 times a second; silent elsewhere
    (a log or a pipe gets no carriage returns)."""

    def __init__(self, label: str, total: int | None, stream: IO[str] | None = None,
                 enabled: bool | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.label = label
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.clock = clock
        self.start = clock()
        self.drawn_at = -1.0
        self.done = 0

    def update(self, done: int) -> None:
        self.done = done
        now = self.clock()
        if self.enabled and now - self.drawn_at >= 0.1:
            self.drawn_at = now
            self.stream.write("\r" + self.line(now) + "\x1b[K")
            self.stream.flush()

    def line(self, now: float | None = None) -> str:
        elapsed = max((self.clock() if now is None else now) - self.start, 1e-9)
        speed = self.done / elapsed
        parts = [self.label]
        if self.total:
            parts.append(bar(self.done / self.total))
            parts.append(f"{format_bytes(self.done)}/{format_bytes(self.total)}")
        else:
            parts.append(format_bytes(self.done))
        parts.append(f"{format_bytes(speed)}/s")
        if self.total and speed > 0:
            parts.append(f"ETA {format_duration((self.total - self.done) / speed)}")
        return "  ".join(parts)

    def close(self) -> None:
        if self.enabled and self.drawn_at >= 0:
            self.stream.write("\r" + self.line() + "\x1b[K\n")
            self.stream.flush()


class ProgressReader(io.RawIOBase):
    """A read-only file that reports how many bytes were read: the SDK's multipart upload
    (httpx) reads it in 64 KiB chunks, so nothing is held whole and the bar follows the wire.
    ``fileno`` is passed through so httpx takes the length from ``fstat``."""

    def __init__(self, raw: IO[bytes], on_read: Callable[[int], None]) -> None:
        super().__init__()
        self.raw = raw
        self.on_read = on_read
        self.position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self.raw.seekable()

    def fileno(self) -> int:
        return self.raw.fileno()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        # httpx seeks to 0 before each send (also on an SDK retry): the bar starts over too.
        self.position = self.raw.seek(offset, whence)
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer: Any) -> int:
        n = self.raw.readinto(buffer)  # type: ignore[attr-defined]
        self.position += n or 0
        self.on_read(self.position)
        return n or 0

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.position += len(data)
        self.on_read(self.position)
        return data
