"""The shard contract: a per-shard setting has one default, and a driver pod gets the same
``DriverConfig`` the worker would build for the same shard (issue 38: object -> argv -> object)."""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest

from aibrix_operators.capacity.mode import SharedCapacity
from aibrix_operators.driver.cli import build_parser, config_from
from aibrix_operators.driver.config import DEFAULT_ENDPOINT_WAIT_S, DriverConfig, default
from aibrix_operators.driver_pods.spec import DriverPodRequest, DriverPodSettings, build_driver_pod
from aibrix_operators.operators.dispatch import DispatchShardOperator
from aibrix_operators.operators.pipeline import BATCH_PARAMS

# The per-shard settings a batch chooses, and the driver CLI's flag for each.
SETTINGS = {"concurrency": "concurrency", "max_attempts": "max_attempts",
            "request_timeout_s": "request_timeout", "outage_budget_s": "outage_budget"}


@pytest.mark.parametrize("name", [*SETTINGS, "endpoint_wait_s"])
def test_each_per_shard_setting_has_one_default_everywhere(name: str) -> None:
    want = DEFAULT_ENDPOINT_WAIT_S if name == "endpoint_wait_s" else default(name)
    operator = inspect.signature(DispatchShardOperator.__init__).parameters[name].default
    pod = {f.name: f.default for f in fields(DriverPodRequest)}[name]
    cli = build_parser().get_default(SETTINGS.get(name, "endpoint_wait"))
    assert (BATCH_PARAMS[name].value, operator, pod, cli) == (want, want, want, want)


def test_a_pods_argv_gives_the_driver_the_config_the_worker_builds() -> None:
    capacity = SharedCapacity(batch_priority=7, target_inflight=3)
    req = DriverPodRequest(
        batch_id="batch_0a750e3a913c42cf", shard_index=2, shard_uri="s3://b/w/shards/shard-00002.jsonl",
        results_prefix="s3://b/w/results/shard-00002", endpoint="http://router.batch.svc:8000",
        total_requests=40, deadline=2_000_000_000.0, attempt=1, model="llama", concurrency=7,
        max_attempts=3, request_timeout_s=45.5, endpoint_wait_s=12.0, outage_budget_s=120.0,
        cancel_uri="s3://b/w/cancel.json", cache_salt="-tenant-salt", capacity_json=capacity.to_json(),
    )
    args = build_parser().parse_args(build_driver_pod(DriverPodSettings(), req, now=1e9).args)
    in_pod = config_from(args)
    # What the dispatch task builds for the same shard in the worker (operators/dispatch.py), less
    # where the key comes from (a connection there, the inference Secret's env var in a pod).
    in_worker = DriverConfig(
        endpoint=req.endpoint, concurrency=7, max_attempts=3, request_timeout_s=45.5, deadline=2e9,
        outage_budget_s=120.0, cancel_uri=req.cancel_uri, cache_salt=req.cache_salt, capacity=capacity,
    )
    key_source = {"api_key", "api_key_env", "api_key_origin", "extra_headers"}
    assert {f.name: getattr(in_pod, f.name) for f in fields(DriverConfig) if f.name not in key_source} == {
        f.name: getattr(in_worker, f.name) for f in fields(DriverConfig) if f.name not in key_source}
    assert (args.shard_uri, args.results_prefix, args.total, args.model, args.endpoint_wait) == (
        req.shard_uri, req.results_prefix, 40, "llama", 12.0)
