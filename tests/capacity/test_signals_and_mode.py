"""Reading an endpoint's /metrics page, and who decides the capacity mode (capacity/)."""

from __future__ import annotations

import pytest

from aibrix_operators.capacity.mode import CapacityRefused, SharedCapacity, choose_capacity
from aibrix_operators.capacity.signals import parse_page, signals_between

# The shape of vLLM 0.32's page: label sets per model and engine, HELP/TYPE lines, a histogram.
PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="tiny"} 7.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} {ttft_sum}
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} {ttft_count}
vllm:num_preemptions_total{engine="0",model_name="tiny"} {preempted}
vllm:num_requests_running_other_thing 99
aibrix_router_waiting_requests{class="batch"} 7
"""


def page(ttft_sum: float, ttft_count: int, preempted: int) -> str:
    return (PAGE.replace("{ttft_sum}", str(ttft_sum)).replace("{ttft_count}", str(ttft_count))
            .replace("{preempted}", str(preempted)))


def test_a_vllm_page_sums_label_sets_and_skips_look_alike_names() -> None:
    p = parse_page(page(1.5, 10, 2))
    assert (p.running, p.waiting, p.kv_usage) == (5.0, 4.0, 0.25)
    assert p.router_online_waiting is None  # the batch class's queue is not online load
    assert p.understood


def test_ttft_and_preemptions_are_rates_between_two_pages() -> None:
    before, now = parse_page(page(1.5, 10, 2)), parse_page(page(3.5, 14, 5))
    s = signals_between(before, now)
    assert s.ttft_s == pytest.approx(0.5)  # 2.0 s over 4 first tokens
    assert s.preempted == 3
    assert signals_between(now, now).ttft_s is None  # no first token in between: no TTFT
    assert signals_between(None, now).ttft_s is None


def test_a_page_without_load_series_is_not_understood() -> None:
    assert not parse_page("# nothing\nprocess_cpu_seconds_total 3\n").understood


def test_the_deployment_decides_the_mode_and_a_trigger_may_only_restate_it() -> None:
    shared = SharedCapacity()
    endpoints = ("http://chat.internal:8000",)
    assert choose_capacity("http://chat.internal:8000/v1", None, endpoints, shared) is shared
    assert choose_capacity("http://chat.internal:8000", "shared", endpoints, shared) is shared
    assert choose_capacity("http://batch.internal:8000", "", endpoints, shared) is None
    with pytest.raises(CapacityRefused, match="is not declared shared"):
        choose_capacity("http://batch.internal:8000", "shared", endpoints, shared)
    with pytest.raises(CapacityRefused, match="also serves online traffic"):
        choose_capacity("http://chat.internal:8000", "dedicated", endpoints, shared)
    with pytest.raises(CapacityRefused, match="is not one of"):
        choose_capacity("http://chat.internal:8000", "polite", endpoints, shared)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"batch_priority": 2**31}, "out of range"),
    ({"batch_priority": True}, "out of range"),
    ({"batch_priority": 0}, "must be greater than shared_online_priority"),
    ({"batch_priority": 5, "online_priority": 5}, "must be greater"),
    ({"target_inflight": 0}, "shared_target_inflight"),
    ({"max_kv_usage": 1.5}, "shared_max_kv_usage"),
    ({"ttft_target_s": 0}, "shared_ttft_target_s"),
])
def test_a_bad_shared_setting_is_refused_by_name(kwargs: dict, message: str) -> None:
    with pytest.raises(CapacityRefused, match=message):
        SharedCapacity(**kwargs)


def test_shared_settings_travel_to_driver_pods_unchanged() -> None:
    settings = SharedCapacity(batch_priority=20, target_inflight=8, ttft_target_s=0.75)
    assert SharedCapacity.from_json(settings.to_json()) == settings
