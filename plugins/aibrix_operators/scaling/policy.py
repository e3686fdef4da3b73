"""The scaling policy: remaining work + deadline + observed throughput + vLLM load → replicas per role.

Pure: no Airflow, no I/O, no clock. The caller passes ``now`` and the ``RoleState``
it got back from the previous decision (earlier recommendations, learnt capacity),
so the same inputs always give the same decision (and tests and the bench can
replay time).

How one role's replicas are chosen:

1. **Deadline floor.** The role must process its remaining tokens (prefill: prompt
   tokens, decode: output tokens) before ``deadline - tail_s``. Replicas already
   ready serve the whole time left; a replica asked for now serves only after
   ``startup_s``. The floor is the fewest replicas that do it at
   ``target_utilization`` of the estimated capacity (the headroom absorbs
   throughput noise). If even ``max_replicas`` cannot, the decision says so
   (``deadline_feasible=False``) and asks for the maximum.
2. **Capacity per replica.** Observed throughput per ready replica is the role's
   capacity only while the role is saturated (requests waiting, or the KV cache
   nearly full); it is learnt as a moving average (``capacity_smoothing``) so one
   noisy interval does not flip the plan. An unsaturated role is limited by its
   neighbour or by the drivers, so its observation is only a lower bound: it
   raises the learnt figure, never lowers it. Until anything is learnt, the
   benchmarked ``nominal_tokens_per_s`` stands in.
3. **Load hold.** A saturated role is never scaled down: fewer replicas would
   only lengthen its queue (and, for decode, drop KV that must be recomputed).
4. **Stabilization** (like the HPA's ``behavior``): a higher recommendation is
   applied only once it held for ``scale_up_window_s`` (the lowest recommendation
   in that window is used), a lower one only as far as the highest
   recommendation in ``scale_down_window_s``. Prefill is short and compute-bound,
   so it scales up at once and down after a short window; decode holds long
   requests and their KV, so it scales conservatively. Neither window can hold a
   role below its deadline floor.
5. **Gangs.** Replicas move in whole pod groups (``gang_size``: the role's
   ``podGroupSize``); min and max must be multiples of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

WorkKind = Literal["prompt_tokens", "output_tokens"]

# Reasons, the ``reason`` of every ScaleDecision (also a metric label, so a closed set).
NO_WORK = "no_work"
DEADLINE = "deadline"
DEADLINE_INFEASIBLE = "deadline_infeasible"
SCALE_UP = "scale_up"
SCALE_DOWN = "scale_down"
HOLD_STABILIZING = "hold_stabilizing"
HOLD_SATURATED = "hold_saturated"
HOLD = "hold"
REASONS = (NO_WORK, DEADLINE, DEADLINE_INFEASIBLE, SCALE_UP, SCALE_DOWN, HOLD_STABILIZING,
           HOLD_SATURATED, HOLD)


@dataclass(frozen=True)
class RolePolicy:
    """How one serving role scales. Replicas count pods, as the role's ``scale`` does."""

    role: str
    work: WorkKind
    min_replicas: int
    max_replicas: int
    nominal_tokens_per_s: float  # per replica, from a benchmark; used until measured
    gang_size: int = 1  # podGroupSize: replicas change in whole pod groups
    startup_s: float = 300.0  # a new replica's time to ready (schedule, pull, load weights)
    tail_s: float = 120.0  # the last requests' own latency: work must be done this early
    target_utilization: float = 0.85
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 120.0
    waiting_per_replica_high: float = 1.0  # queued requests per replica that mean "saturated"
    kv_usage_high: float = 0.9
    capacity_smoothing: float = 0.3  # weight of a new saturated observation in the learnt capacity

    def __post_init__(self) -> None:
        if self.gang_size < 1:
            raise ValueError(f"{self.role}: gang_size must be >= 1")
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < self.gang_size:
            raise ValueError(f"{self.role}: need 0 <= min_replicas <= max_replicas, max >= gang_size")
        if self.min_replicas % self.gang_size or self.max_replicas % self.gang_size:
            raise ValueError(f"{self.role}: min/max replicas must be multiples of gang_size "
                             f"{self.gang_size} (whole pod groups)")
        if self.nominal_tokens_per_s <= 0 or not 0 < self.target_utilization <= 1:
            raise ValueError(f"{self.role}: nominal_tokens_per_s > 0 and 0 < target_utilization <= 1")
        if min(self.startup_s, self.tail_s, self.scale_up_window_s, self.scale_down_window_s) < 0:
            raise ValueError(f"{self.role}: times must be >= 0")

    @classmethod
    def prefill(cls, **kwargs: Any) -> RolePolicy:
        """Compute-bound, short requests: up at once, down after a short window."""
        defaults: dict[str, Any] = {"role": "prefill", "work": "prompt_tokens",
                                    "scale_up_window_s": 0.0, "scale_down_window_s": 120.0}
        return cls(**{**defaults, **kwargs})

    @classmethod
    def decode(cls, **kwargs: Any) -> RolePolicy:
        """Memory-bound, long requests holding KV: up after a window, down after a long one."""
        defaults: dict[str, Any] = {"role": "decode", "work": "output_tokens",
                                    "scale_up_window_s": 120.0, "scale_down_window_s": 600.0}
        return cls(**{**defaults, **kwargs})

    def to_gang(self, replicas: float) -> int:
        """Whole pod groups (rounded up), within [min, max]."""
        groups = math.ceil(max(replicas, 0) / self.gang_size - 1e-9)
        return min(max(groups * self.gang_size, self.min_replicas), self.max_replicas)


@dataclass(frozen=True)
class RemainingWork:
    """What is left of the batch: unanswered requests and their tokens.

    ``output_tokens`` is the requests' ``max_tokens`` scaled by the output/max ratio
    seen so far (an upper bound until answers arrive).
    """

    requests: int
    prompt_tokens: float
    output_tokens: float

    def tokens(self, kind: WorkKind) -> float:
        return self.prompt_tokens if kind == "prompt_tokens" else self.output_tokens


@dataclass(frozen=True)
class RoleObservation:
    """One role as seen now: its replicas, its throughput, and vLLM's load gauges."""

    current_replicas: int  # spec.replicas now
    ready_replicas: int
    tokens_per_s: float | None = None  # the role's total over the last interval; None: unmeasured
    running: float = 0.0  # vllm:num_requests_running, summed over the role's pods
    waiting: float = 0.0  # vllm:num_requests_waiting, summed
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc, mean over the pods (0..1)


@dataclass(frozen=True)
class Recommendation:
    at: float
    replicas: int


@dataclass(frozen=True)
class ScaleDecision:
    """One role's decision, with everything it was based on (task log, XCom, metric)."""

    role: str
    at: float
    current_replicas: int
    desired_replicas: int
    recommendation: int  # before stabilization
    deadline_replicas: int  # the deadline floor (may exceed max_replicas)
    deadline_feasible: bool
    capacity_per_replica: float
    capacity_source: str  # observed_saturated | observed | nominal
    saturated: bool
    reason: str
    message: str
    inputs: dict[str, Any]
    state: RoleState = field(default_factory=lambda: RoleState(), repr=False)

    @property
    def changed(self) -> bool:
        return self.desired_replicas != self.current_replicas

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (XCom, log line); the state travels separately (``state.as_dict()``)."""
        out = asdict(self)
        del out["state"]
        return out


@dataclass(frozen=True)
class RoleState:
    """What one decision hands to the next: recent recommendations and the learnt capacity."""

    recommendations: tuple[Recommendation, ...] = ()
    capacity_per_replica: float | None = None  # learnt from saturated observations

    def as_dict(self) -> dict[str, Any]:
        return {"recommendations": [[r.at, r.replicas] for r in self.recommendations],
                "capacity_per_replica": self.capacity_per_replica}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> RoleState:
        data = data or {}
        recs = tuple(Recommendation(float(at), int(n)) for at, n in data.get("recommendations") or ())
        cap = data.get("capacity_per_replica")
        return cls(recs, float(cap) if cap is not None else None)


def capacity_per_replica(
    policy: RolePolicy, obs: RoleObservation, learnt: float | None = None
) -> tuple[float, str, bool]:
    """(tokens/s one replica can do, where that figure comes from, whether the role is saturated)."""
    ready = max(obs.ready_replicas, 0)
    saturated = ready > 0 and (
        obs.waiting / ready > policy.waiting_per_replica_high or obs.kv_usage >= policy.kv_usage_high
    )
    if obs.tokens_per_s is None or ready == 0 or obs.tokens_per_s <= 0:
        if learnt is not None:
            return learnt, "learnt", saturated
        return policy.nominal_tokens_per_s, "nominal", saturated
    observed = obs.tokens_per_s / ready
    if saturated:
        if learnt is None:
            return observed, "observed_saturated", True
        a = policy.capacity_smoothing
        return a * observed + (1 - a) * learnt, "observed_saturated", True
    # Unsaturated: the observation is a lower bound of what a replica can do.
    prior = learnt if learnt is not None else policy.nominal_tokens_per_s
    if observed >= prior:
        return observed, "observed", False
    return prior, "learnt" if learnt is not None else "nominal", False


def deadline_replicas(
    policy: RolePolicy, tokens: float, ready: int, capacity: float, time_left_s: float
) -> int:
    """The fewest replicas that finish ``tokens`` in time (ungated; may exceed max).

    Ready replicas work for ``time_left - tail``; new ones ``startup_s`` less.
    ``max_replicas + 1`` stands for "not possible with new replicas at all".
    """
    if tokens <= 0:
        return 0
    per_replica_rate = capacity * policy.target_utilization
    serve_s = time_left_s - policy.tail_s
    if serve_s <= 0 or per_replica_rate <= 0:  # (an observed rate can underflow to 0)
        return policy.max_replicas + 1
    if ready * per_replica_rate * serve_s >= tokens:
        return _replicas_for(tokens / (per_replica_rate * serve_s), policy.max_replicas)
    new_serve_s = serve_s - policy.startup_s
    if new_serve_s <= 0:
        return policy.max_replicas + 1
    missing = tokens - ready * per_replica_rate * serve_s
    return ready + _replicas_for(missing / (per_replica_rate * new_serve_s), policy.max_replicas)


def _replicas_for(exact: float, max_replicas: int) -> int:
    # Any work at all needs a replica; the epsilon only keeps exact fits from rounding up.
    # Beyond max the precise figure is moot (and a near-zero observed rate must not overflow).
    if not exact <= max_replicas + 1:
        return max_replicas + 1
    return max(1, math.ceil(exact - 1e-9))


def _prune(hist: tuple[Recommendation, ...]) -> tuple[Recommendation, ...]:
    """Drop the recommendations no window can need, so the state stays small at any interval.

    The windows are always the newest entries (``now - at <= window``), and only their max
    (scale-down) and min (scale-up) matter. An entry with a later one at least as high and
    a later one at least as low is never either: any window holding it holds those too.
    What is left is a falling run of maxima and a rising run of minima, at most two
    entries per distinct replica count, whatever the interval.
    """
    kept: list[Recommendation] = []
    later_max, later_min = -math.inf, math.inf
    for h in reversed(hist):
        if h.replicas > later_max or h.replicas < later_min:
            kept.append(h)
        later_max, later_min = max(later_max, h.replicas), min(later_min, h.replicas)
    return tuple(reversed(kept))


def decide(
    policy: RolePolicy,
    work: RemainingWork,
    obs: RoleObservation,
    now: float,
    deadline: float,
    state: RoleState | None = None,
) -> ScaleDecision:
    """Desired replicas for one role now; pass the returned ``state`` to the next call."""
    state = state or RoleState()
    capacity, source, saturated = capacity_per_replica(policy, obs, state.capacity_per_replica)
    learnt = capacity if source != "nominal" else state.capacity_per_replica
    tokens = work.tokens(policy.work)
    time_left = deadline - now
    current = obs.current_replicas
    inputs = {
        "remaining_requests": work.requests, "remaining_tokens": tokens, "work": policy.work,
        "time_left_s": round(time_left, 3), "ready_replicas": obs.ready_replicas,
        "tokens_per_s": obs.tokens_per_s, "running": obs.running, "waiting": obs.waiting,
        "kv_usage": obs.kv_usage, "min_replicas": policy.min_replicas,
        "max_replicas": policy.max_replicas, "gang_size": policy.gang_size,
    }

    def result(desired: int, rec: int, need: int, reason: str, message: str,
               hist: tuple[Recommendation, ...]) -> ScaleDecision:
        return ScaleDecision(
            role=policy.role, at=now, current_replicas=current, desired_replicas=desired,
            recommendation=rec, deadline_replicas=need, deadline_feasible=need <= policy.max_replicas,
            capacity_per_replica=capacity, capacity_source=source, saturated=saturated,
            reason=reason, message=message, inputs=inputs, state=RoleState(hist, learnt),
        )

    if work.requests <= 0 or tokens <= 0:
        # Done: nothing to stabilize against; keep no history (a new batch starts afresh).
        floor = policy.to_gang(0)
        return result(floor, floor, 0, NO_WORK, f"no {policy.work} left: scale to {floor}", ())

    need = deadline_replicas(policy, tokens, obs.ready_replicas, capacity, time_left)
    floor = policy.to_gang(need)
    rec = floor
    if saturated:
        rec = max(rec, policy.to_gang(obs.ready_replicas))
    keep_s = max(policy.scale_up_window_s, policy.scale_down_window_s)
    recent = tuple(h for h in state.recommendations if now - h.at <= keep_s)
    hist = _prune((*recent, Recommendation(now, rec)))
    plan = (f"{tokens:.0f} {policy.work} in {time_left:.0f}s at {capacity:.1f}/s per replica "
            f"({source}) x {policy.target_utilization:g} needs {need}")

    if need > policy.max_replicas:
        desired = policy.max_replicas
        return result(desired, rec, need, DEADLINE_INFEASIBLE,
                      f"{plan} > max {policy.max_replicas}: deadline at risk, scale to max", hist)
    if rec > current:
        # The lowest recommendation of the up-window (window 0: just this one).
        up = min(h.replicas for h in hist if now - h.at <= policy.scale_up_window_s)
        desired = policy.to_gang(max(current, up, floor))
        if desired > current and desired <= floor:
            return result(desired, rec, need, DEADLINE, f"{plan}: up to the deadline floor", hist)
        if desired > current:
            return result(desired, rec, need, SCALE_UP, f"{plan}: saturated, scale up", hist)
        return result(desired, rec, need, HOLD_STABILIZING,
                      f"{plan}: up to {rec} not yet held for {policy.scale_up_window_s:g}s", hist)
    if rec < current:
        down = max(h.replicas for h in hist if now - h.at <= policy.scale_down_window_s)
        desired = policy.to_gang(min(current, down))
        if desired < current:
            return result(desired, rec, need, SCALE_DOWN, f"{plan}: scale down", hist)
        return result(desired, rec, need, HOLD_STABILIZING,
                      f"{plan}: down to {rec} held back by the {policy.scale_down_window_s:g}s window", hist)
    desired = policy.to_gang(current)
    if saturated and rec > floor:
        return result(desired, rec, need, HOLD_SATURATED, f"{plan}: saturated, not scaling down", hist)
    return result(desired, rec, need, HOLD, f"{plan}: hold", hist)


def decide_roles(
    policies: Mapping[str, RolePolicy],
    work: RemainingWork,
    observations: Mapping[str, RoleObservation],
    now: float,
    deadline: float,
    states: Mapping[str, RoleState] | None = None,
) -> dict[str, ScaleDecision]:
    """One decision per role, each on its own (prefill and decode never wait for each other)."""
    states = states or {}
    return {
        role: decide(policy, work, observations[role], now, deadline, states.get(role))
        for role, policy in policies.items()
    }
