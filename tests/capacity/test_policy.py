"""The shared-mode control law, rule by rule (capacity/policy.py)."""

from __future__ import annotations

import pytest

from aibrix_operators.capacity import policy
from aibrix_operators.capacity.policy import ControlLimits, decide
from aibrix_operators.capacity.signals import EndpointSignals

LIMITS = ControlLimits(max_limit=64, target_inflight=32, batch_queue=2)


def sig(running: float = 0, waiting: float = 0, kv: float | None = 0.1, ttft: float | None = None,
        online_waiting: float | None = None) -> EndpointSignals:
    return EndpointSignals(running=running, waiting=waiting, kv_usage=kv, ttft_s=ttft, preempted=0,
                           online_waiting=online_waiting)


def test_an_idle_server_is_filled_at_once_up_to_the_target_and_a_short_queue() -> None:
    d = decide(1, LIMITS, sig(running=1), 1, 0)
    # target_inflight plus batch_queue, not max_limit: the endpoint's own bound.
    assert (d.limit, d.reason) == (LIMITS.target_inflight + LIMITS.batch_queue, policy.GROW_IDLE)


def test_online_load_takes_its_share_first() -> None:
    # 20 online requests at the endpoint, 10 of ours: batch may run 32 - 20, and queue 2 more.
    d = decide(30, LIMITS, sig(running=30), ours_in_flight=10, backpressure=0)
    assert d.online == 20
    assert d.limit == 14 and d.reason == policy.ONLINE_SHARE


def test_a_burst_that_fills_the_endpoint_drops_batch_to_the_floor_at_once() -> None:
    d = decide(30, LIMITS, sig(running=32, waiting=12), ours_in_flight=10, backpressure=0)
    assert (d.limit, d.reason) == (0, policy.ONLINE_WAITING)
    # Filled but nobody waiting yet: still out of the way.
    d = decide(30, LIMITS, sig(running=32), ours_in_flight=0, backpressure=0)
    assert (d.limit, d.reason) == (0, policy.ONLINE_SHARE)


def test_only_batch_waiting_beyond_the_queue_shrinks_to_what_the_server_runs() -> None:
    # Nothing online; 24 of ours out, 8 of them queued: the server runs 16; 2 may queue.
    d = decide(24, LIMITS, sig(running=16, waiting=8), ours_in_flight=24, backpressure=0)
    assert (d.limit, d.reason) == (18, policy.SERVER_FULL)
    # Queued within the allowance: not a reason to shrink.
    assert decide(18, LIMITS, sig(running=16, waiting=2), 18, 0).limit == 34


def test_backpressure_halves_whatever_the_page_says() -> None:
    d = decide(20, LIMITS, sig(running=0), ours_in_flight=20, backpressure=3)
    assert (d.limit, d.reason) == (10, policy.BACKPRESSURE)


def test_kv_cache_and_ttft_cut_by_thirty_percent() -> None:
    assert decide(20, LIMITS, sig(running=20, kv=0.99), 20, 0).reason == policy.KV_CACHE
    assert decide(20, LIMITS, sig(running=20, kv=0.99), 20, 0).limit == 14
    limits = ControlLimits(max_limit=64, target_inflight=32, ttft_target_s=0.5)
    d = decide(20, limits, sig(running=20, ttft=0.9), 20, 0)
    assert (d.limit, d.reason) == (14, policy.TTFT)
    assert decide(20, limits, sig(running=20, ttft=0.2), 20, 0).limit > 20


def test_growth_beside_online_traffic_is_additive_and_weighted_by_urgency() -> None:
    calm = decide(4, LIMITS, sig(running=6), ours_in_flight=4, backpressure=0, urgency=1.0)
    urgent = decide(4, LIMITS, sig(running=6), ours_in_flight=4, backpressure=0, urgency=4.0)
    assert (calm.limit, calm.reason) == (5, policy.GROW_SHARED)
    assert urgent.limit == 8


def test_without_a_load_page_the_limit_follows_answers_only_and_never_stops_at_zero() -> None:
    assert decide(0, LIMITS, None, 0, 0).limit == 1
    assert decide(8, LIMITS, None, 8, 0) == policy.Decision(9, policy.NO_SIGNALS, 0.0)  # additive growth
    assert decide(32, LIMITS, None, 32, 0).limit == 32  # up to the target, no further
    assert decide(8, LIMITS, None, 8, 2).limit == 4


def test_the_router_view_counts_only_its_online_queue() -> None:
    # A router reports 3 online requests queued in front of it: floor, even with no vLLM queue.
    d = decide(10, LIMITS, sig(running=12, waiting=0, online_waiting=3), ours_in_flight=10, backpressure=0)
    assert (d.limit, d.reason) == (0, policy.ONLINE_WAITING)
    # Queued batch requests at the router are not online load.
    d = decide(10, LIMITS, sig(running=10, waiting=0, online_waiting=0), ours_in_flight=10, backpressure=0)
    assert d.limit == 34


@pytest.mark.parametrize("limit", [0, 1, 7, 64])
def test_the_limit_stays_within_its_bounds(limit: int) -> None:
    for signals in (sig(), sig(running=100, waiting=50), sig(kv=1.0), None):
        for bp in (0, 5):
            d = decide(limit, LIMITS, signals, limit, bp)
            assert 0 <= d.limit <= LIMITS.max_limit
