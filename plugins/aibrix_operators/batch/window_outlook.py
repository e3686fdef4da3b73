"""Will a batch (or one shard) finish in its completion window at the rate measured so far?

One judgement for the driver's progress lines and metric (per shard) and the Batch API's status
line (per batch), so the two never disagree on what "at risk" means.
"""

from __future__ import annotations

from dataclasses import dataclass

# A rate measured over less than this is noise (the first requests of a shard are slow).
MIN_ELAPSED_S = 10.0


@dataclass(frozen=True)
class WindowOutlook:
    remaining: int  # requests not answered yet
    rate: float  # requests answered per second so far
    needed_s: float  # remaining / rate
    left_s: float  # until the window closes

    @property
    def at_risk(self) -> bool:
        return self.needed_s > self.left_s

    def line(self) -> str:
        """One line for a person: what is left, at what rate, against the time left."""
        if self.at_risk:
            return (f"at risk: {self.remaining} requests left need ~{self.needed_s:.0f}s at {self.rate:.1f} "
                    f"req/s, but the window closes in {max(self.left_s, 0.0):.0f}s")
        return (f"on track: {self.remaining} requests left, ~{self.needed_s:.0f}s at {self.rate:.1f} req/s; "
                f"the window closes in {self.left_s:.0f}s")


def window_outlook(remaining: int, answered: int, elapsed_s: float, left_s: float) -> WindowOutlook | None:
    """The outlook from ``answered`` requests in ``elapsed_s``; None when there is nothing left
    to judge, or too little measured to judge it (under MIN_ELAPSED_S, or nothing answered)."""
    if remaining <= 0 or elapsed_s < MIN_ELAPSED_S or answered <= 0:
        return None
    rate = answered / elapsed_s
    return WindowOutlook(remaining, rate, remaining / rate, left_s)
