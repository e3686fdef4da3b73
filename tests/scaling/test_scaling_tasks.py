"""The Airflow pieces of scaling against the API double, through the provider's Kubernetes
hooks and the real clients: the readiness trigger, an autoscale tick that scales and
defers with its state, the end when every shard is done, scale-down, and local mode."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowSkipException, TaskDeferred

from aibrix_operators.batch.shard_results import ResultLog, fingerprint_shard, results_prefix
from aibrix_operators.batch.sharding import ShardSpec
from aibrix_operators.sensors.scaling import (
    DECISIONS_KEY,
    AutoscaleSensor,
    RolesReadySensor,
    ScaleDownOperator,
)
from aibrix_operators.storage import LocalStorage
from aibrix_operators.triggers.scaling import RolesReadyTrigger
from tests.scaling.k8s_scaling_double import STORMSERVICES, ScalingCluster, storm_service

NS = "batch"
ROLES = {
    "prefill": {"kind": "StormService", "name": "llm", "min_replicas": 2, "max_replicas": 16, "gang_size": 2,
                "nominal_tokens_per_s": 100.0, "startup_s": 0, "tail_s": 0, "target_utilization": 1.0},
    "decode": {"kind": "StormService", "name": "llm", "min_replicas": 2, "max_replicas": 16, "gang_size": 2,
               "nominal_tokens_per_s": 10.0, "startup_s": 0, "tail_s": 0, "target_utilization": 1.0,
               "idle_replicas": 0},
}


@pytest.fixture
def configured(scaling_cluster: ScalingCluster, monkeypatch: pytest.MonkeyPatch) -> ScalingCluster:
    monkeypatch.setenv("AIRFLOW_CONN_K8S_SCALING", scaling_cluster.airflow_connection(NS))
    monkeypatch.setenv("AIRFLOW__AIBRIX_SCALING__ROLES", json.dumps(ROLES))
    monkeypatch.setenv("AIRFLOW__AIBRIX_SCALING__KUBERNETES_CONN_ID", "k8s_scaling")
    monkeypatch.setenv("AIRFLOW__AIBRIX_SCALING__NAMESPACE", NS)
    scaling_cluster.add(STORMSERVICES, NS, storm_service("llm", 2, 2, {"prefill": 2, "decode": 2}))
    return scaling_cluster


def roles_of(cluster: ScalingCluster) -> dict[str, int]:
    obj = cluster.get(STORMSERVICES, NS, "llm")
    return {r["name"]: r["replicas"] for r in obj["spec"]["template"]["spec"]["roles"]}


def _request(i: int) -> bytes:
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "x" * 400}]}}).encode()


def _answer(i: int) -> bytes:
    return json.dumps({"custom_id": f"r{i}", "error": None, "response": {"status_code": 200, "body": {
        "usage": {"prompt_tokens": 100, "completion_tokens": 100}}}}).encode()


class FakeTI:
    """What the sensor uses of the runtime task instance: XCom, and the dispatch task
    instances' states (the Execution API's ``get_ti_count``)."""

    dag_id = "batch_inference"

    def __init__(self, dispatch_states: list[str] | None = None) -> None:
        self.xcom: dict[str, Any] = {}
        self.dispatch_states = dispatch_states or []

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcom[key] = json.loads(json.dumps(value))  # XCom values must be JSON

    def get_ti_count(self, dag_id: str, task_ids: list[str], run_ids: list[str],
                     states: list[str]) -> int:
        assert (dag_id, task_ids, run_ids) == ("batch_inference", ["dispatch"], ["run_1"])
        return sum(s in states for s in self.dispatch_states)


def batch(tmp_path: Path, n: int, window_s: float) -> tuple[dict[str, Any], list[dict[str, Any]], ResultLog]:
    shard_file = tmp_path / "shard-00000.jsonl"
    shard_file.write_bytes(b"\n".join(_request(i) for i in range(n)) + b"\n")
    out = tmp_path / "out"
    now = int(time.time())
    validated = {"batch_id": "batch_1", "input_uri": str(shard_file), "output_uri": str(out),
                 "endpoint": "/v1/chat/completions", "model": "m", "total_requests": n,
                 "total_bytes": shard_file.stat().st_size, "created_at": now, "expires_at": now + window_s,
                 "completion_window": "24h", "metadata": {}, "max_line_bytes": 1 << 20,
                 "last_request_line": n}
    shard = ShardSpec(0, str(shard_file), 1, n, shard_file.stat().st_size)
    storage = LocalStorage()
    log = ResultLog(storage, results_prefix(str(out / "_work" / "run_1"), shard.name),
                    fingerprint_shard(storage, shard.uri).binding)
    return validated, [shard.as_dict()], log


async def test_roles_ready_trigger_waits_for_ready_pods(configured: ScalingCluster) -> None:
    configured.set_ready(STORMSERVICES, NS, "llm", 0, role="decode")
    targets = [{"role": r, "kind": "StormService", "name": "llm", "namespace": NS}
               for r in ("prefill", "decode")]
    trigger = RolesReadyTrigger(targets, {"prefill": 2, "decode": 2}, "k8s_scaling", poll_interval_s=0.05)
    classpath, kwargs = trigger.serialize()
    assert classpath == "aibrix_operators.triggers.scaling.RolesReadyTrigger"
    threading.Timer(0.3, lambda: configured.set_ready(STORMSERVICES, NS, "llm", 2, role="decode")).start()
    events = [e async for e in RolesReadyTrigger(**kwargs).run()]
    assert [e.payload["status"] for e in events] == ["ready"]
    assert events[0].payload["ready"] == {"prefill": 2, "decode": 2}


async def test_roles_ready_trigger_reports_forbidden_and_timeout(configured: ScalingCluster) -> None:
    targets = [{"role": "decode", "kind": "StormService", "name": "llm", "namespace": NS}]
    configured.api.fail("GET", r"/stormservices/llm$", 403)
    events = [e async for e in RolesReadyTrigger(targets, {"decode": 2}, "k8s_scaling").run()]
    assert events[0].payload["status"] == "error" and "forbidden" in events[0].payload["message"]
    configured.set_ready(STORMSERVICES, NS, "llm", 0, role="decode")
    trigger = RolesReadyTrigger(targets, {"decode": 2}, "k8s_scaling", poll_interval_s=0.05, timeout_s=0.2)
    events = await asyncio.wait_for(_collect(trigger), 10)
    assert events[0].payload["status"] == "error" and "not ready after" in events[0].payload["message"]


async def _collect(trigger: RolesReadyTrigger) -> list[Any]:
    return [e async for e in trigger.run()]


def test_roles_ready_sensor_scales_to_the_deadline_floor_then_defers(configured: ScalingCluster,
                                                                     tmp_path: Path) -> None:
    # 40 requests x 100 prompt tokens at 100 tok/s per prefill replica in ~13 s: the 2 ready
    # do 2600, 1400 more need 2 new → 4; 4000 output tokens at 10 tok/s per decode replica
    # need ~31 → max 16 (deadline_infeasible).
    validated, _, _ = batch(tmp_path, 40, window_s=13.0)
    op = RolesReadySensor(task_id="roles_ready", validated=validated, execution_mode="kubernetes")
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({})
    assert roles_of(configured) == {"prefill": 4, "decode": 16}
    assert isinstance(deferred.value.trigger, RolesReadyTrigger)
    assert deferred.value.trigger.want == {"prefill": 2, "decode": 2}
    assert op.execute_complete({}, {"status": "ready", "ready": {"prefill": 2, "decode": 2}})["scaled"]
    with pytest.raises(AirflowException, match="not ready"):
        op.execute_complete({}, {"status": "error", "message": "roles not ready after 1s"})


def test_autoscale_ticks_scale_defer_with_state_and_end_when_done(configured: ScalingCluster,
                                                                  tmp_path: Path) -> None:
    validated, shards, log = batch(tmp_path, 40, window_s=3600.0)
    op = AutoscaleSensor(task_id="autoscale", validated=validated, shards=shards, execution_mode="kubernetes",
                         interval_s=30)
    ti = FakeTI()
    ctx: dict[str, Any] = {"run_id": "run_1", "ti": ti}
    # 40 x 100 output tokens at 10 tok/s in 3600 s: 1 replica → min 2; prefill likewise 2.
    with pytest.raises(TaskDeferred) as first:
        op.execute(ctx)  # the first decision at once, with a scrape of its own
    assert first.value.method_name == "tick"
    assert first.value.trigger.moment == pytest.approx(time.time() + 30, abs=5)
    state = json.loads(json.dumps(first.value.kwargs["state"]))  # survives serialization
    assert roles_of(configured) == {"prefill": 2, "decode": 2}
    assert [d["reason"] for d in ti.xcom[DECISIONS_KEY]["decode"]] == ["hold"]

    # 100 s later (replayed by moving the window and the last tick back): 10 answers came,
    # 1000 output tokens / 100 s over 2 replicas = 5 tok/s each, under the nominal 10 and not
    # saturated, so the nominal stands; 100 s are left: decode must grow to the deadline floor.
    op.validated = {**validated, "expires_at": time.time() + 100}
    state["last"]["at"] -= 100
    for i in range(10):
        log.append(_answer(i))
    log.flush()
    with pytest.raises(TaskDeferred) as second:
        op.tick(ctx, event=None, state=state)
    decode = ti.xcom[DECISIONS_KEY]["decode"][-1]
    # 30 left x 100 output tokens = 3000 tokens in ~100 s at 10 tok/s → 4 replicas (gang 2).
    assert decode["reason"] == "deadline" and decode["desired_replicas"] == 4
    assert decode["inputs"]["remaining_requests"] == 30
    assert decode["inputs"]["tokens_per_s"] == pytest.approx(10, rel=0.05)
    assert roles_of(configured)["decode"] == 4

    for i in range(10, 40):
        log.append(_answer(i))
    log.flush()
    out = op.tick(ctx, event=None, state=second.value.kwargs["state"])
    assert out == {"ended": "every shard is done", "answered": 40, "total": 40}


def test_autoscale_ends_when_every_dispatch_task_finished_even_failed(configured: ScalingCluster,
                                                                      tmp_path: Path) -> None:
    """A shard whose dispatch failed for good never writes its answers: the autoscaler stops
    once every dispatch task instance is finished (not while one is up for retry)."""
    validated, shards, log = batch(tmp_path, 40, window_s=3600.0)
    two = [shards[0], {**shards[0], "index": 1}]
    op = AutoscaleSensor(task_id="autoscale", validated=validated, shards=two, execution_mode="kubernetes")
    ti = FakeTI(["success", "up_for_retry"])
    ctx: dict[str, Any] = {"run_id": "run_1", "ti": ti}
    with pytest.raises(TaskDeferred):
        op.tick(ctx, state={})
    ti.dispatch_states = ["success", "failed"]
    out = op.tick(ctx, state={})
    assert out["ended"] == "every dispatch task has finished (1 of 2 failed)"
    assert out["answered"] == 0 and out["total"] == 80


def test_autoscale_survives_a_500_and_fails_on_403(configured: ScalingCluster, tmp_path: Path) -> None:
    validated, shards, _ = batch(tmp_path, 40, window_s=3600.0)
    op = AutoscaleSensor(task_id="autoscale", validated=validated, shards=shards, execution_mode="kubernetes")
    ctx: dict[str, Any] = {"run_id": "run_1", "ti": FakeTI()}
    configured.api.fail("GET", r"/stormservices/llm$", 500, times=50)
    with pytest.raises(TaskDeferred):  # logged, tried again at the next tick
        op.tick(ctx, state={})
    configured.api.clear_faults()
    configured.api.fail("GET", r"/stormservices/llm$", 403, times=50)
    with pytest.raises(AirflowException, match="forbidden"):
        op.tick(ctx, state={})


def test_scale_down_sets_idle_replicas_and_reports_failures(configured: ScalingCluster) -> None:
    op = ScaleDownOperator(task_id="scale_down", execution_mode="kubernetes")
    assert op.trigger_rule == "all_done"
    assert op.execute({}) == {"prefill": 2, "decode": 2}
    assert roles_of(configured) == {"prefill": 0, "decode": 0}


def test_local_mode_touches_nothing(configured: ScalingCluster, tmp_path: Path) -> None:
    validated, shards, _ = batch(tmp_path, 4, window_s=3600.0)
    n = len(configured.store.requests)
    assert RolesReadySensor(task_id="r", validated=validated).execute({}) == {"scaled": False}
    with pytest.raises(AirflowSkipException):
        AutoscaleSensor(task_id="a", validated=validated, shards=shards).execute({"run_id": "x"})
    with pytest.raises(AirflowSkipException):
        ScaleDownOperator(task_id="s", execution_mode="local").execute({})
    assert len(configured.store.requests) == n  # no API call at all


def test_autoscale_state_in_the_deferral_stays_bounded(configured: ScalingCluster, tmp_path: Path) -> None:
    """Tick after tick the kwargs the deferral carries stop growing: the last KEEP_DECISIONS
    decisions per role, a pruned recommendation history, one cursor number per attempt.
    Every decision is still in the task log."""
    from aibrix_operators.sensors.scaling import KEEP_DECISIONS

    validated, shards, log = batch(tmp_path, 40, window_s=3600.0)
    op = AutoscaleSensor(task_id="autoscale", validated=validated, shards=shards, execution_mode="kubernetes")
    ctx: dict[str, Any] = {"run_id": "run_1", "ti": FakeTI()}
    state: dict[str, Any] = {}
    sizes = []
    for tick in range(3 * KEEP_DECISIONS):
        log.append(_answer(tick))
        log.flush()  # a segment per tick
        with pytest.raises(TaskDeferred) as deferred:
            op.tick(ctx, event=None, state=state)
        state = json.loads(json.dumps(deferred.value.kwargs["state"]))
        sizes.append(len(json.dumps(state)))
    assert [len(state["decisions"][r]) for r in ("prefill", "decode")] == [KEEP_DECISIONS] * 2
    assert max(sizes[KEEP_DECISIONS:]) <= sizes[KEEP_DECISIONS] * 1.1, sizes
    assert len(state["progress"]["shards"]["shard-00000"]["seen"]) == 1  # 30 segments, 1 attempt
    # Same recommendation every tick: one entry, not one per tick.
    assert [len(state["roles"][r]["recommendations"]) for r in ("prefill", "decode")] == [1, 1]


def test_the_scaling_tasks_are_sensors_whose_poke_is_the_condition(configured: ScalingCluster,
                                                                   tmp_path: Path) -> None:
    """Sensors in Airflow's sense (issue 20): RolesReadySensor's poke is the readiness check
    (deferrable=False pokes in the worker until it holds); AutoscaleSensor's poke is one tick,
    done once the batch has ended."""
    from airflow.sdk import BaseSensorOperator

    assert issubclass(RolesReadySensor, BaseSensorOperator)
    assert issubclass(AutoscaleSensor, BaseSensorOperator)
    validated, shards, log = batch(tmp_path, 40, window_s=3600.0)
    ready = RolesReadySensor(task_id="roles_ready", validated=validated, execution_mode="kubernetes")
    assert (ready.poke_interval, ready.timeout) == (10.0, 1800.0)
    configured.set_ready(STORMSERVICES, NS, "llm", 0, role="decode")
    assert not ready.poke({}).is_done
    configured.set_ready(STORMSERVICES, NS, "llm", 2, role="decode")
    poked = ready.poke({})
    assert poked.is_done and poked.xcom_value == {"scaled": True, "ready": {"prefill": 2, "decode": 2}}
    # In the worker: scales, then pokes (no deferral) and returns the poke's value.
    in_worker = RolesReadySensor(task_id="roles_ready", validated=validated, execution_mode="kubernetes",
                                 deferrable=False, poll_interval_s=0.05, timeout_s=5)
    assert in_worker.execute({}) == {"scaled": True, "ready": {"prefill": 2, "decode": 2}}

    auto = AutoscaleSensor(task_id="autoscale", validated=validated, shards=shards,
                           execution_mode="kubernetes")
    ctx: dict[str, Any] = {"run_id": "run_1", "ti": FakeTI()}
    assert not auto.poke(ctx).is_done  # a tick: decided and applied, the batch goes on
    assert roles_of(configured) == {"prefill": 2, "decode": 2}
    for i in range(40):
        log.append(_answer(i))
    log.flush()
    done = auto.poke(ctx)
    assert done.is_done and done.xcom_value == {"ended": "every shard is done", "answered": 40, "total": 40}
