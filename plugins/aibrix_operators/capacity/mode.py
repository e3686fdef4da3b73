"""Which capacity mode an endpoint runs batches in, and the shared mode's settings.

The deployment decides, per endpoint (``[aibrix_batch] shared_endpoints``, the same patterns
as ``allowed_endpoints``): an endpoint that also serves online traffic is ``shared``, any other
is ``dedicated`` (the batch may use all of it). A trigger's ``capacity_mode`` may only restate
that: asking for ``shared`` on an endpoint the deployment did not declare shared, or for
``dedicated`` on one it did, is refused by name — whoever triggers must not take a shared
fleet for their batch, nor believe they are being polite on a fleet that is not shared.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from aibrix_operators.batch.error_codes import BatchFailure, CodedFailure
from aibrix_operators.trust.policy import endpoint_matches

SHARED = "shared"
DEDICATED = "dedicated"
MODES = ("", SHARED, DEDICATED)  # "": the deployment's mode for the endpoint
# vLLM's priority is an int; lower runs first, and requests without one have 0 (online traffic).
PRIORITY_RANGE = (-(2**31), 2**31 - 1)


class CapacityRefused(CodedFailure, ValueError):
    """A trigger's or the deployment's capacity setting that cannot apply; says which and why."""

    error_code, retryable = BatchFailure.CAPACITY_MODE_REFUSED, False


@dataclass(frozen=True)
class SharedCapacity:
    """Shared mode's settings, from the deployment; travels to driver pods as JSON."""

    batch_priority: int = 10
    online_priority: int = 0
    target_inflight: int = 64
    max_waiting: int = 0
    batch_queue: int = 4
    max_kv_usage: float = 0.95
    ttft_target_s: float | None = None
    tick_s: float = 0.5
    # Withdraw batch requests in flight when online requests wait at a full endpoint (their
    # work so far is lost and redone later); off: they run to the end of their generation.
    preempt_for_online: bool = True

    def __post_init__(self) -> None:
        low, high = PRIORITY_RANGE
        for name in ("batch_priority", "online_priority"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise CapacityRefused(
                    f"shared_{name} {value!r} is out of range: vLLM's priority is an integer in "
                    f"[{low}, {high}]"
                )
        if self.batch_priority <= self.online_priority:
            raise CapacityRefused(
                f"shared_batch_priority {self.batch_priority} must be greater than shared_online_priority "
                f"{self.online_priority}: vLLM runs lower values first, so batch would displace online "
                "requests"
            )
        if self.target_inflight < 1:
            raise CapacityRefused(f"shared_target_inflight must be >= 1, got {self.target_inflight}")
        if self.batch_queue < 0:
            raise CapacityRefused(f"shared_batch_queue must be >= 0, got {self.batch_queue}")
        if self.max_waiting < 0:
            raise CapacityRefused(f"shared_max_waiting must be >= 0, got {self.max_waiting}")
        if not 0 < self.max_kv_usage <= 1:
            raise CapacityRefused(f"shared_max_kv_usage must be in (0, 1], got {self.max_kv_usage}")
        if self.ttft_target_s is not None and self.ttft_target_s <= 0:
            raise CapacityRefused(f"shared_ttft_target_s must be > 0 seconds, got {self.ttft_target_s}")
        if self.tick_s <= 0:
            raise CapacityRefused(f"shared_tick_s must be > 0 seconds, got {self.tick_s}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SharedCapacity:
        return cls(**json.loads(text))


def choose_capacity(
    endpoint: str, requested: str | None, shared_endpoints: tuple[str, ...], shared: SharedCapacity,
    source: str = "the deployment",
) -> SharedCapacity | None:
    """Shared mode's settings for ``endpoint``, or ``None`` for dedicated mode."""
    requested = (requested or "").strip().lower()
    if requested not in MODES:
        raise CapacityRefused(f"capacity_mode {requested!r} is not one of 'shared', 'dedicated' or empty "
                              "(the deployment's mode for the endpoint)")
    declared = any(endpoint_matches(pattern, endpoint) for pattern in shared_endpoints)
    if requested == SHARED and not declared:
        raise CapacityRefused(
            f"capacity_mode 'shared': endpoint {endpoint!r} is not declared shared in {source}'s "
            f"shared_endpoints ({', '.join(shared_endpoints) or 'none'}); leave capacity_mode empty, or ask "
            "the deployment to declare it"
        )
    if requested == DEDICATED and declared:
        raise CapacityRefused(
            f"capacity_mode 'dedicated': endpoint {endpoint!r} also serves online traffic ({source}'s "
            "shared_endpoints), so batches run there in shared mode only; leave capacity_mode empty"
        )
    return shared if declared else None
