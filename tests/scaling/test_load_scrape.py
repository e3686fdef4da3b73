"""vLLM load into the autoscaler: the tick trigger lists the role's pods through the API
double (real ``kubernetes_asyncio`` client via the provider's AsyncKubernetesHook), reads
each Ready pod's ``/metrics`` over HTTP (real vLLM exposition text), and the sensor feeds
running / waiting / KV usage to the policy."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred

from aibrix_operators.scaling.load import RoleLoad, aggregate
from aibrix_operators.sensors.scaling import DECISIONS_KEY, AutoscaleSensor
from aibrix_operators.triggers.scaling import AutoscaleTickTrigger
from tests.scaling.k8s_scaling_double import STORMSERVICES, ScalingCluster, storm_service
from tests.scaling.test_scaling_tasks import NS, FakeTI, batch, configured  # noqa: F401 - fixture
from tests.scaling.vllm_pods import REAL_METRICS, MetricsServers, add_pod, role_pod, vllm_metrics


@pytest.fixture
def servers() -> Iterator[MetricsServers]:
    s = MetricsServers()
    yield s
    s.close()


def test_real_vllm_text_parses_to_its_gauges() -> None:
    assert aggregate([REAL_METRICS]) == RoleLoad(pods=1)  # the captured idle server
    load = aggregate([vllm_metrics(3, 5, 0.5), vllm_metrics(1, 0, 0.9)], unreachable=1)
    assert (load.pods, load.unreachable, load.running, load.waiting) == (2, 1, 4.0, 5.0)
    assert load.kv_usage == pytest.approx(0.7)  # mean over the pods
    assert aggregate([], unreachable=2) == RoleLoad(unreachable=2)


def sources() -> list[dict[str, Any]]:
    return [{"role": r, "namespace": NS, "port": "http", "path": "/metrics",
             "selector": f"app.kubernetes.io/name=vllm,app.kubernetes.io/component={r}"}
            for r in ("prefill", "decode")]


async def fire(trigger: AutoscaleTickTrigger) -> dict[str, Any]:
    classpath, kwargs = trigger.serialize()
    assert classpath == "aibrix_operators.triggers.scaling.AutoscaleTickTrigger"
    events = [e async for e in AutoscaleTickTrigger(**json.loads(json.dumps(kwargs))).run()]
    assert len(events) == 1 and events[0].payload["status"] == "tick"
    return events[0].payload


async def test_tick_trigger_scrapes_ready_pods_of_each_role(configured: ScalingCluster,  # noqa: F811
                                                            servers: MetricsServers) -> None:
    store = configured.store
    add_pod(store, NS, role_pod("decode-0", "decode", servers.serve(vllm_metrics(3, 5, 0.5))))
    add_pod(store, NS, role_pod("decode-1", "decode", servers.serve(vllm_metrics(1, 0, 0.9))))
    # Not Ready (still loading weights): its numbers must not count.
    starting = servers.serve(vllm_metrics(100, 100, 1.0))
    add_pod(store, NS, role_pod("decode-2", "decode", starting, ready=False))
    gone = servers.serve(vllm_metrics(100, 100, 1.0))  # Ready, but stops answering
    add_pod(store, NS, role_pod("decode-3", "decode", gone))
    servers.stop(gone)
    add_pod(store, NS, role_pod("prefill-0", "prefill", servers.serve(vllm_metrics(7, 40, 0.1))))

    started = time.time()
    payload = await fire(AutoscaleTickTrigger(started + 0.3, sources(), "k8s_scaling", scrape_timeout_s=2))
    assert time.time() - started >= 0.3  # waited for its moment
    decode, prefill = (RoleLoad.from_dict(payload["load"][r]) for r in ("decode", "prefill"))
    assert (decode.pods, decode.unreachable, decode.running, decode.waiting) == (2, 1, 4.0, 5.0)
    assert decode.kv_usage == pytest.approx(0.7) and decode.error is None
    assert (prefill.pods, prefill.running, prefill.waiting) == (1, 7.0, 40.0)
    assert servers.scrapes[starting] == 0
    lists = [p for m, p in store.requests if m == "GET" and p.startswith(f"/api/v1/namespaces/{NS}/pods")]
    assert len(lists) == 2  # one list per role, by its selector


async def test_tick_trigger_says_why_load_is_missing(configured: ScalingCluster) -> None:  # noqa: F811
    configured.api.fail("GET", rf"/namespaces/{NS}/pods", 403, times=1)
    payload = await fire(AutoscaleTickTrigger(0, sources()[:1], "k8s_scaling"))
    assert "forbidden" in payload["load"]["prefill"]["error"]
    payload = await fire(AutoscaleTickTrigger(0, sources()[:1], "no_such_conn"))
    assert payload["load"]["prefill"]["error"] and payload["load"]["prefill"]["pods"] == 0


def test_autoscale_feeds_the_scraped_load_to_the_policy(configured: ScalingCluster,  # noqa: F811
                                                       servers: MetricsServers, tmp_path: Path) -> None:
    """8 decode replicas, little work left. vLLM says the role is saturated (a long queue, KV
    nearly full): the first decision, scraped by the task itself, holds all 8 and records what
    it saw. A later tick whose trigger saw a calm role scales down to the floor."""
    configured.store.remove(STORMSERVICES, NS, "llm")
    configured.add(STORMSERVICES, NS, storm_service("llm", 2, 8, {"prefill": 2, "decode": 8}))
    for i in range(2):  # rank 0 of two TP groups (gang_size 2: only rank 0 serves /metrics)
        add_pod(configured.store, NS, role_pod(f"decode-g{i}-0", "decode", servers.serve(
            vllm_metrics(running=128, waiting=200, kv_usage=0.97))))
    validated, shards, _ = batch(tmp_path, 4, window_s=3600.0)
    op = AutoscaleSensor(task_id="autoscale", validated=validated, shards=shards, execution_mode="kubernetes")
    ti = FakeTI()
    ctx: dict[str, Any] = {"run_id": "run_1", "ti": ti}
    with pytest.raises(TaskDeferred) as first:
        op.execute(ctx)
    d = ti.xcom[DECISIONS_KEY]["decode"][-1]
    assert d["saturated"] and d["reason"] == "hold_saturated" and d["desired_replicas"] == 8
    assert (d["inputs"]["waiting"], d["inputs"]["running"], d["inputs"]["kv_usage"]) == (400, 256, 0.97)
    trigger = first.value.trigger
    assert isinstance(trigger, AutoscaleTickTrigger) and {s["role"] for s in trigger.sources} == {
        "prefill", "decode"}
    assert trigger.moment >= time.time() + 9  # the interval, at least MIN_INTERVAL_S

    calm = {"decode": RoleLoad(pods=8, running=3).as_dict(), "prefill": RoleLoad(pods=2).as_dict()}
    with pytest.raises(TaskDeferred):
        op.tick(ctx, event={"status": "tick", "load": calm}, state={})
    d = ti.xcom[DECISIONS_KEY]["decode"][-1]
    assert not d["saturated"] and d["reason"] == "scale_down" and d["desired_replicas"] == 2


async def test_tensor_parallel_groups_are_read_at_rank_0(configured: ScalingCluster,  # noqa: F811
                                                         servers: MetricsServers) -> None:
    """Plain overlay roles: only a group's rank 0 serves HTTP; the headless ranks (no server)
    are neither scraped nor counted unreachable. The settings come from the config parser."""
    from aibrix_operators.scaling.config import parse_roles

    roles = parse_roles({"decode": {"kind": "StatefulSetGroups", "name": "decode", "min_replicas": 0,
                                    "max_replicas": 8, "gang_size": 2, "nominal_tokens_per_s": 10}}, NS)
    rs = roles["decode"]
    assert (rs.target.kind, rs.target.group_size, rs.metrics.rank0_only) == ("StatefulSetGroups", 2, True)
    closed = socket.socket()  # a port nobody listens on: what a headless rank's :8000 is
    closed.bind(("127.0.0.1", 0))
    headless = closed.getsockname()[1]
    closed.close()
    for g, (running, waiting) in enumerate([(2, 1), (5, 0)]):
        add_pod(configured.store, NS, role_pod(f"decode-g{g}-0", "decode", servers.serve(
            vllm_metrics(running, waiting, 0.4))))
        add_pod(configured.store, NS, role_pod(f"decode-g{g}-1", "decode", headless))
    payload = await fire(AutoscaleTickTrigger(0, [rs.metrics.__dict__], "k8s_scaling"))
    load = RoleLoad.from_dict(payload["load"]["decode"])
    assert (load.pods, load.unreachable, load.running, load.waiting) == (2, 0, 7.0, 1.0)
