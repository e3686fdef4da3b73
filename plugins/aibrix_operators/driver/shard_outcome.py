"""What one driver run of a shard reports (``ShardOutcome``, the task's XCom), and the failure
of a shard that no longer holds what was planned (``ShardChanged``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from aibrix_operators.batch.error_codes import BatchFailure, CodedFailure


class ShardChanged(CodedFailure):
    """The shard does not hold the requests the task was planned for."""

    error_code, retryable = BatchFailure.INPUT_CHANGED, False


@dataclass
class ShardOutcome:
    """What one driver run did; it lands in XCom, so only plain types."""

    shard: str
    total: int
    resumed: int = 0  # answered by an earlier, interrupted run
    resumed_failed: int = 0  # of those, answered with an error line
    completed: int = 0
    failed: int = 0
    retries: int = 0
    elapsed_s: float = 0.0
    usage: dict[str, Any] = field(default_factory=dict)
    attempt_id: str = ""
    outages: int = 0  # times the breaker paused the shard
    paused_s: float = 0.0
    checkpoint_write_retries: int = 0
    cancelled: bool = False
    stopped_by: str | None = None  # the stop rule that stopped the batch (batch/stop_rules.py)
    engine_s: float | None = None  # its share of the endpoint's time (driver/engine_time.py); None: unknown

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
