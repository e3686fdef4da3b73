"""Properties of the scaling policy (hypothesis): bounds, gangs, monotone in backlog,
stabilization, and enough capacity for the deadline whenever max_replicas allows it."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aibrix_operators.scaling.policy import (
    DEADLINE_INFEASIBLE,
    HOLD_SATURATED,
    HOLD_STABILIZING,
    NO_WORK,
    REASONS,
    Recommendation,
    RemainingWork,
    RoleObservation,
    RolePolicy,
    RoleState,
    deadline_replicas,
    decide,
    decide_roles,
)

# Deterministic and quick on a loaded 2-core box: derandomize, no per-example deadline.
PROPS = settings(max_examples=300, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow])


@st.composite
def policies(draw: st.DrawFn) -> RolePolicy:
    gang = draw(st.integers(1, 4))
    lo = draw(st.integers(0, 4)) * gang
    hi = lo + draw(st.integers(1, 16)) * gang
    make = draw(st.sampled_from([RolePolicy.prefill, RolePolicy.decode]))
    return make(min_replicas=lo, max_replicas=hi, gang_size=gang,
                nominal_tokens_per_s=draw(st.floats(10, 20_000)),
                startup_s=draw(st.floats(0, 900)), tail_s=draw(st.floats(0, 300)),
                target_utilization=draw(st.floats(0.5, 1.0)))


def observations(p: RolePolicy) -> st.SearchStrategy[RoleObservation]:
    return st.builds(
        RoleObservation,
        current_replicas=st.integers(0, p.max_replicas + 4),
        ready_replicas=st.integers(0, p.max_replicas),
        tokens_per_s=st.one_of(st.none(), st.floats(0, 200_000)),
        running=st.floats(0, 500), waiting=st.floats(0, 500), kv_usage=st.floats(0, 1),
    )


def histories(p: RolePolicy, now: float) -> st.SearchStrategy[RoleState]:
    rec = st.builds(Recommendation, at=st.floats(now - 1200, now - 1),
                    replicas=st.integers(p.min_replicas // p.gang_size, p.max_replicas // p.gang_size)
                    .map(lambda g: g * p.gang_size))
    recs = st.lists(rec, max_size=12).map(lambda hs: tuple(sorted(hs, key=lambda h: h.at)))
    return st.builds(RoleState, recs, st.one_of(st.none(), st.floats(1, 20_000)))


NOW = 1_000_000.0
backlog = st.floats(0, 5e9)
time_left = st.floats(-100, 172_800)


def work(tokens: float) -> RemainingWork:
    return RemainingWork(requests=math.ceil(tokens / 100), prompt_tokens=tokens, output_tokens=tokens)


@PROPS
@given(st.data(), backlog, time_left)
def test_within_bounds_and_gang_sized(data: st.DataObject, tokens: float, left: float) -> None:
    p = data.draw(policies())
    obs = data.draw(observations(p))
    d = decide(p, work(tokens), obs, NOW, NOW + left, data.draw(histories(p, NOW)))
    assert p.min_replicas <= d.desired_replicas <= p.max_replicas
    assert d.desired_replicas % p.gang_size == 0
    assert d.recommendation % p.gang_size == 0
    assert d.reason in REASONS
    assert d.reason == NO_WORK or d.state.recommendations[-1] == Recommendation(NOW, d.recommendation)


@PROPS
@given(st.data(), backlog, backlog, time_left)
def test_monotone_in_backlog(data: st.DataObject, a: float, b: float, left: float) -> None:
    p = data.draw(policies())
    obs = data.draw(observations(p))
    hist = data.draw(histories(p, NOW))
    small, big = sorted((a, b))
    d_small = decide(p, work(small), obs, NOW, NOW + left, hist)
    d_big = decide(p, work(big), obs, NOW, NOW + left, hist)
    assert d_small.desired_replicas <= d_big.desired_replicas
    assert d_small.deadline_replicas <= d_big.deadline_replicas


@PROPS
@given(st.data(), backlog, st.floats(400, 172_800))
def test_meets_the_deadline_when_capacity_allows(data: st.DataObject, tokens: float, left: float) -> None:
    """If max_replicas can do it, the desired replicas can: ready ones for the whole time,
    the new ones after their start-up, at the planned utilization of the estimated capacity."""
    p = data.draw(policies())
    obs = data.draw(observations(p))
    d = decide(p, work(tokens), obs, NOW, NOW + left, data.draw(histories(p, NOW)))
    if tokens <= 0 or d.reason == NO_WORK:
        return
    rate = d.capacity_per_replica * p.target_utilization
    serve = left - p.tail_s

    def can_do(replicas: int) -> float:
        ready = min(obs.ready_replicas, replicas)
        return ready * rate * serve + (replicas - ready) * rate * max(serve - p.startup_s, 0)

    if d.deadline_feasible:
        assert can_do(d.desired_replicas) >= tokens * (1 - 1e-6), d
        # The floor is tight: one replica fewer would not do (so it does not over-provision).
        assert can_do(d.deadline_replicas) >= tokens * (1 - 1e-6)
        assert d.deadline_replicas == 1 or can_do(d.deadline_replicas - 1) < tokens * (1 + 1e-6)
    else:
        assert d.reason == DEADLINE_INFEASIBLE and d.desired_replicas == p.max_replicas
        # ...and it really is infeasible with max_replicas.
        full = (min(obs.ready_replicas, p.max_replicas) * rate * serve
                + max(p.max_replicas - obs.ready_replicas, 0) * rate * max(serve - p.startup_s, 0))
        assert full < tokens * (1 + 1e-6) or serve <= 0


@PROPS
@given(st.data(), st.lists(st.tuples(backlog, st.integers(0, 50)), min_size=2, max_size=25),
       st.floats(20_000, 90_000))
def test_respects_the_stabilization_window(data: st.DataObject, steps: list[tuple[float, int]],
                                           left: float) -> None:
    """Over any sequence of decisions (time moving 0..50 s apart), a scale-down never goes
    below the highest recommendation inside the down-window, and a load-driven scale-up
    (above the deadline floor) never exceeds the lowest recommendation in the up-window."""
    p = data.draw(policies())
    obs = data.draw(observations(p))
    current, hist, now = obs.current_replicas, RoleState(), NOW
    recs: list[Recommendation] = []
    for tokens, dt in steps:
        now += dt
        o = RoleObservation(current, obs.ready_replicas, obs.tokens_per_s, obs.running, obs.waiting,
                            obs.kv_usage)
        d = decide(p, work(tokens), o, now, NOW + left, hist)
        if d.reason == NO_WORK:
            recs = []
        else:
            recs.append(Recommendation(now, d.recommendation))
            down_window = [r.replicas for r in recs if now - r.at <= p.scale_down_window_s]
            up_window = [r.replicas for r in recs if now - r.at <= p.scale_up_window_s]
            if d.desired_replicas < current:
                assert d.desired_replicas >= min(p.to_gang(current), max(down_window)), d
            if d.desired_replicas > p.to_gang(current) and d.reason != DEADLINE_INFEASIBLE:
                assert d.desired_replicas <= max(min(up_window), p.to_gang(d.deadline_replicas)), d
        current, hist = d.desired_replicas, d.state
        # Bounded state (it rides in the deferral's kwargs): two entries per replica count at most.
        assert len(hist.recommendations) <= 2 * (p.max_replicas // p.gang_size + 1)


def decode_policy(**kw: object) -> RolePolicy:
    base: dict[str, object] = {"min_replicas": 2, "max_replicas": 16, "gang_size": 2,
                               "nominal_tokens_per_s": 1000, "startup_s": 300, "tail_s": 0,
                               "target_utilization": 1.0}
    return RolePolicy.decode(**{**base, **kw})


def test_deadline_floor_matches_hand_computation() -> None:
    p = decode_policy()
    # 4 ready replicas x 1000 tok/s x 3600 s = 14.4M tokens; 20M needs 5.6M more from new
    # replicas serving 3300 s: ceil(5.6M / 3.3M) = 2 more → 6.
    assert deadline_replicas(p, 20e6, 4, 1000, 3600) == 6
    assert deadline_replicas(p, 14.4e6, 4, 1000, 3600) == 4
    assert deadline_replicas(p, 7.2e6, 4, 1000, 3600) == 2
    assert deadline_replicas(p, 1e6, 4, 1000, 200) == p.max_replicas + 1  # too late even to start
    d = decide(p, RemainingWork(100, 0, 20e6), RoleObservation(4, 4, 4000.0, 100, 0, 0.5), 0, 3600)
    assert (d.desired_replicas, d.reason, d.capacity_source) == (6, "deadline", "observed")
    assert d.inputs["remaining_tokens"] == 20e6 and "needs 6" in d.message


def test_decode_waits_out_its_windows_and_prefill_does_not() -> None:
    dec = decode_policy(scale_up_window_s=120, scale_down_window_s=600)
    pre = RolePolicy.prefill(min_replicas=2, max_replicas=16, gang_size=2, nominal_tokens_per_s=1000,
                             startup_s=300, tail_s=0, target_utilization=1.0, scale_down_window_s=60)
    obs8 = RoleObservation(8, 8, None)
    # Little work left: the floor is 2; decode holds 8 through its 600 s window, prefill drops after 60 s.
    small = RemainingWork(10, 1e5, 1e5)
    big = RemainingWork(10, 1e9, 1e9)
    h_dec = decide(dec, big, obs8, 0, 86_400).state
    h_pre = decide(pre, big, obs8, 0, 86_400).state
    d = decide(dec, small, obs8, 30, 86_400, h_dec)
    assert (d.desired_replicas, d.reason) == (8, HOLD_STABILIZING)
    assert decide(pre, small, obs8, 30, 86_400, h_pre).desired_replicas == 8
    assert decide(pre, small, obs8, 61, 86_400, h_pre).desired_replicas == 2
    assert decide(dec, small, obs8, 599, 86_400, h_dec).desired_replicas == 8
    assert decide(dec, small, obs8, 601, 86_400, h_dec).desired_replicas == 2


def test_decode_load_scale_up_waits_for_its_up_window() -> None:
    """Above the deadline floor, a saturated decode role grows only once the higher
    recommendation held for scale_up_window_s; the lowest one in the window is applied."""
    p = decode_policy(scale_up_window_s=120)
    little = RemainingWork(10, 0, 1e5)  # floor: 2

    def saturated(current: int, ready: int) -> RoleObservation:
        return RoleObservation(current, ready, 1000.0 * ready, running=64, waiting=200, kv_usage=0.95)

    d0 = decide(p, little, saturated(4, 4), 0, 86_400)
    assert (d0.desired_replicas, d0.reason) == (4, HOLD_SATURATED)
    # Two more pods came up (someone else scaled): recommendation 6, but held at 4 for 120 s.
    d1 = decide(p, little, saturated(4, 6), 60, 86_400, d0.state)
    assert (d1.recommendation, d1.desired_replicas, d1.reason) == (6, 4, HOLD_STABILIZING)
    d2 = decide(p, little, saturated(4, 8), 150, 86_400, d1.state)  # window (30, 150]: recs 6, 8
    assert (d2.desired_replicas, d2.reason) == (6, "scale_up")
    prefill = RolePolicy.prefill(**{**p.__dict__, "role": "prefill", "work": "output_tokens",
                                    "scale_up_window_s": 0})
    assert decide(prefill, little, saturated(4, 8), 150, 86_400, d1.state).desired_replicas == 8


def test_saturated_role_is_not_scaled_down_and_its_observation_is_capacity() -> None:
    p = decode_policy()
    # 8 ready, 400 waiting: saturated; observed 4000 tok/s = 500 per replica (< nominal 1000).
    obs = RoleObservation(8, 8, 4000.0, running=256, waiting=400, kv_usage=0.97)
    d = decide(p, RemainingWork(10, 0, 1e5), obs, 0, 86_400)
    assert d.saturated and d.capacity_source == "observed_saturated" and d.capacity_per_replica == 500
    assert (d.desired_replicas, d.reason) == (8, HOLD_SATURATED)
    # Unsaturated, the same observation is only a lower bound: nominal is used.
    calm = RoleObservation(8, 8, 4000.0, running=10, waiting=0, kv_usage=0.2)
    assert decide(p, RemainingWork(10, 0, 1e5), calm, 0, 86_400).capacity_source == "nominal"


def test_no_work_scales_to_min_at_once_and_history_round_trips() -> None:
    p = decode_policy()
    d = decide(p, RemainingWork(0, 0, 0), RoleObservation(12, 12, 1e4), 5, 100,
               RoleState((Recommendation(1, 12),)))
    assert (d.desired_replicas, d.reason, d.state.recommendations) == (2, NO_WORK, ())
    d2 = decide(p, RemainingWork(5, 1, 1e6), RoleObservation(4, 4, 4000.0, waiting=50), 10, 86_400)
    assert RoleState.from_dict(json.loads(json.dumps(d2.state.as_dict()))) == d2.state
    assert d2.state.capacity_per_replica == 1000.0
    assert "state" not in d2.as_dict() and json.loads(json.dumps(d2.as_dict()))["reason"] == d2.reason


def test_capacity_is_learnt_from_saturated_observations_and_smoothed() -> None:
    p = decode_policy(capacity_smoothing=0.5)
    work = RemainingWork(10, 0, 1e6)
    d1 = decide(p, work, RoleObservation(4, 4, 2400.0, waiting=40), 0, 86_400)
    assert (d1.capacity_per_replica, d1.capacity_source) == (600, "observed_saturated")
    # A noisy saturated interval moves it half way only.
    d2 = decide(p, work, RoleObservation(4, 4, 3200.0, waiting=40), 60, 86_400, d1.state)
    assert d2.capacity_per_replica == 700
    # Unsaturated and slower (its neighbour is the bottleneck): the learnt figure stands,
    # not the optimistic nominal 1000; faster unsaturated observations raise it.
    d3 = decide(p, work, RoleObservation(4, 4, 800.0), 120, 86_400, d2.state)
    assert (d3.capacity_per_replica, d3.capacity_source) == (700, "learnt")
    d4 = decide(p, work, RoleObservation(4, 4, 3600.0), 180, 86_400, d3.state)
    assert (d4.capacity_per_replica, d4.capacity_source) == (900, "observed")


def test_decide_roles_decides_each_role_on_its_own_work() -> None:
    pre = RolePolicy.prefill(min_replicas=1, max_replicas=8, nominal_tokens_per_s=10_000, tail_s=0,
                             startup_s=0, target_utilization=1.0)
    dec = decode_policy(startup_s=0)
    out = decide_roles({"prefill": pre, "decode": dec}, RemainingWork(1000, 36e6 * 3, 3.6e6 * 7),
                       {"prefill": RoleObservation(1, 1), "decode": RoleObservation(2, 2)}, 0, 3600)
    assert out["prefill"].desired_replicas == 3 and out["decode"].desired_replicas == 8


@pytest.mark.parametrize("kw", [
    {"min_replicas": 1, "max_replicas": 8, "gang_size": 2},  # min not a whole gang
    {"min_replicas": 4, "max_replicas": 2},
    {"min_replicas": 0, "max_replicas": 4, "target_utilization": 0},
])
def test_policy_rejects_bad_settings(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RolePolicy.decode(nominal_tokens_per_s=kw.pop("nominal", 100), **kw)
