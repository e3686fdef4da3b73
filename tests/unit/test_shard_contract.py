"""The shard contract: a per-shard setting has one default, and a driver pod gets the same
``DriverConfig`` the worker would build for the same shard (issue 38: object -> argv -> object)."""

from __future__ import annotations

import inspect
import json
from dataclasses import fields

import pytest

from aibrix_operators.batch.stop_rules import StopRules
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
    cli = build_parser().get_default(SETTINGS.get(name, "endpoint_wait"))
    assert (BATCH_PARAMS[name].value, operator, cli) == (want, want, want)
    if name == "endpoint_wait_s":  # the preflight's wait: the pod request's own field
        assert {f.name: f.default for f in fields(DriverPodRequest)}[name] == want


def _worker_config(**more: object) -> DriverConfig:
    """What the dispatch task builds for a shard in the worker (operators/dispatch.py)."""
    return DriverConfig(
        endpoint="http://router.batch.svc:8000", concurrency=7, max_attempts=3, request_timeout_s=45.5,
        deadline=2e9, outage_budget_s=120.0, cancel_uri="s3://b/w/cancel.json", cache_salt="-tenant-salt",
        capacity=SharedCapacity(batch_priority=7, target_inflight=3),
        stop_rules=StopRules(max_error_rate=0.25, error_rate_min_sample=40, max_total_tokens=10_000),
        stop_prefix="s3://b/w/stop", **more,
    )


def test_a_pod_gets_the_workers_config_as_itself_and_never_its_key() -> None:
    in_worker = _worker_config(api_key_env=None, api_key="sk-connection-password",
                               api_key_origin="http://router.batch.svc:8000")
    req = DriverPodRequest(
        batch_id="batch_0a750e3a913c42cf", shard_index=2, shard_uri="s3://b/w/shards/shard-00002.jsonl",
        results_prefix="s3://b/w/results/shard-00002", total_requests=40, attempt=1,
        config=in_worker.for_pod(), model="llama", endpoint_wait_s=12.0,
    )
    argv = build_driver_pod(DriverPodSettings(), req, now=1e9).args
    args = build_parser().parse_args(argv)
    in_pod = config_from(args)
    # Object -> one JSON -> object: every field equal, the key's source the pod's Secret.
    assert in_pod == in_worker.for_pod()
    assert (in_pod.api_key, in_pod.api_key_env, in_pod.api_key_origin) == (None, "OPENAI_API_KEY", None)
    assert not any("sk-connection-password" in a for a in argv)
    assert (args.shard_uri, args.results_prefix, args.total, args.model, args.endpoint_wait) == (
        req.shard_uri, req.results_prefix, 40, "llama", 12.0)


def test_a_pod_config_is_checked_as_the_workers_and_refuses_what_it_does_not_know() -> None:
    good = json.loads(_worker_config().for_pod().to_json())
    with pytest.raises(ValueError, match=r"unknown fields \['max_retries'\]"):
        DriverConfig.from_json(json.dumps({**good, "max_retries": 3}))
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        DriverConfig.from_json(json.dumps({**good, "concurrency": 0}))
    bad_rate = {**good["stop_rules"], "max_error_rate": 3}
    with pytest.raises(ValueError, match="max_error_rate must be a fraction"):  # rules checked in the pod too
        DriverConfig.from_json(json.dumps({**good, "stop_rules": bad_rate}))
    with pytest.raises(ValueError, match=r"unknown stop rule\(s\) \['max_cost'\]"):
        DriverConfig.from_json(json.dumps({**good, "stop_rules": {"max_cost": 1}}))
    with pytest.raises(ValueError, match="no endpoint"):
        DriverConfig.from_json(json.dumps({k: v for k, v in good.items() if k != "endpoint"}))
    with pytest.raises(ValueError, match="not JSON"):
        DriverConfig.from_json("{concurrency: 7}")
    with pytest.raises(ValueError, match="api_key"):  # a key is never part of a pod's config
        DriverConfig.from_json(json.dumps({**good, "api_key": "sk-smuggled"}))
    # The pod's CLI takes the config whole: a flag beside it is refused, not silently merged.
    parser = build_parser()
    args = parser.parse_args(["--shard-uri", "s", "--results-prefix", "r", "--concurrency", "9",
                              f"--config-json={json.dumps(good)}"])
    with pytest.raises(ValueError, match="do not give --concurrency too"):
        config_from(args, parser)
