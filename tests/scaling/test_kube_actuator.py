"""The actuator through the real ``kubernetes`` / ``kubernetes_asyncio`` clients, over HTTP,
against the API double: scale subresource, StormService role replicas with optimistic
concurrency, and the API's errors (403, 404, 409, 500)."""

from __future__ import annotations

import pytest

from aibrix_operators.scaling.kube import (
    RoleReplicas,
    RoleScaler,
    ScaleTarget,
    ScalingError,
    ready_replicas_async,
)
from tests.scaling.k8s_scaling_double import (
    DEPLOYMENTS,
    STATEFULSETS,
    STORMSERVICES,
    ScalingCluster,
    storm_service,
    workload,
)

NS = "batch"


def sync_client(cluster: ScalingCluster):
    from kubernetes import config

    return config.new_client_from_config(config_file=str(cluster.kubeconfig))


def scaler(cluster: ScalingCluster) -> RoleScaler:
    return RoleScaler(sync_client(cluster), attempts=4, backoff_s=0.0)


@pytest.mark.parametrize("kind,prefix", [("Deployment", DEPLOYMENTS), ("StatefulSet", STATEFULSETS)])
def test_workload_scale_subresource(scaling_cluster: ScalingCluster, kind: str, prefix: str) -> None:
    scaling_cluster.add(prefix, NS, workload(kind, "decode", 2, 2))
    target = ScaleTarget("decode", kind, "decode", NS)  # type: ignore[arg-type]
    s = scaler(scaling_cluster)
    assert s.replicas(target) == RoleReplicas(2, 2)
    assert s.scale(target, 6) == 2
    assert scaling_cluster.get(prefix, NS, "decode")["spec"]["replicas"] == 6
    plural = prefix.rsplit("/", 1)[-1]
    assert ("PATCH", f"/apis/apps/v1/namespaces/{NS}/{plural}/decode/scale") in scaling_cluster.store.requests
    # Same value: read only, no write.
    n = len(scaling_cluster.store.requests)
    assert s.scale(target, 6) == 6
    assert [m for m, _ in scaling_cluster.store.requests[n:]] == ["GET"]
    assert s.replicas(target) == RoleReplicas(6, 2)  # ready lags until pods come up


def test_stormservice_role_replicas_leave_the_other_role_alone(scaling_cluster: ScalingCluster) -> None:
    scaling_cluster.add(STORMSERVICES, NS, storm_service("llm", 2, 4, {"prefill": 2, "decode": 3}))
    s = scaler(scaling_cluster)
    prefill = ScaleTarget("prefill", "StormService", "llm", NS)
    decode = ScaleTarget("decode", "StormService", "llm", NS)
    assert s.replicas(decode) == RoleReplicas(4, 3)
    assert s.scale(prefill, 8) == 2
    roles = scaling_cluster.get(STORMSERVICES, NS, "llm")["spec"]["template"]["spec"]["roles"]
    assert [(r["name"], r["replicas"], r["podGroupSize"]) for r in roles] == [
        ("prefill", 8, 2), ("decode", 4, 2)]


def test_stormservice_conflict_is_retried_on_fresh_read(scaling_cluster: ScalingCluster) -> None:
    """A concurrent writer changes decode between our read and our patch of prefill: the API
    says 409 (stale resourceVersion), we re-read and patch again, and both changes survive."""
    scaling_cluster.add(STORMSERVICES, NS, storm_service("llm", 2, 4))
    raced = []

    def concurrent_writer(path: str) -> None:
        if not raced:
            raced.append(path)

            def bump(o):
                o["spec"]["template"]["spec"]["roles"][1]["replicas"] = 10
                return o

            scaling_cluster.store.update(STORMSERVICES, NS, "llm", bump)

    scaling_cluster.api.before_patch = concurrent_writer
    assert scaler(scaling_cluster).scale(ScaleTarget("prefill", "StormService", "llm", NS), 6) == 2
    roles = scaling_cluster.get(STORMSERVICES, NS, "llm")["spec"]["template"]["spec"]["roles"]
    assert [r["replicas"] for r in roles] == [6, 10]
    patches = [p for m, p in scaling_cluster.store.requests if m == "PATCH"]
    assert len(patches) == 2  # the first one got 409


def test_stormservice_endless_conflicts_give_up_with_409(scaling_cluster: ScalingCluster) -> None:
    scaling_cluster.add(STORMSERVICES, NS, storm_service("llm", 2, 4))
    scaling_cluster.api.fail("PATCH", r"/stormservices/llm$", 409, times=10)
    with pytest.raises(ScalingError, match="409") as err:
        scaler(scaling_cluster).scale(ScaleTarget("prefill", "StormService", "llm", NS), 6)
    assert err.value.status == 409
    roles = scaling_cluster.get(STORMSERVICES, NS, "llm")["spec"]["template"]["spec"]["roles"]
    assert roles[0]["replicas"] == 2


def test_server_errors_are_retried_then_succeed(scaling_cluster: ScalingCluster) -> None:
    scaling_cluster.add(DEPLOYMENTS, NS, workload("Deployment", "prefill", 2, 2))
    fault = scaling_cluster.api.fail("PATCH", r"/deployments/prefill/scale$", 500, times=2)
    assert scaler(scaling_cluster).scale(ScaleTarget("prefill", "Deployment", "prefill", NS), 4) == 2
    assert fault.hits == 2
    assert scaling_cluster.get(DEPLOYMENTS, NS, "prefill")["spec"]["replicas"] == 4


def test_persistent_500_fails_after_the_attempts(scaling_cluster: ScalingCluster) -> None:
    scaling_cluster.add(DEPLOYMENTS, NS, workload("Deployment", "prefill", 2, 2))
    fault = scaling_cluster.api.fail("GET", r"/deployments/prefill$", 500, times=100)
    with pytest.raises(ScalingError, match="HTTP 500") as err:
        scaler(scaling_cluster).replicas(ScaleTarget("prefill", "Deployment", "prefill", NS))
    assert (err.value.status, fault.hits) == (500, 4)


def test_forbidden_is_not_retried_and_says_what_to_grant(scaling_cluster: ScalingCluster) -> None:
    scaling_cluster.add(DEPLOYMENTS, NS, workload("Deployment", "decode", 2, 2))
    fault = scaling_cluster.api.fail("PATCH", r"/scale$", 403, times=100)
    with pytest.raises(ScalingError, match=r"may not patch deployments/scale 'decode' in namespace 'batch'"):
        scaler(scaling_cluster).scale(ScaleTarget("decode", "Deployment", "decode", NS), 4)
    assert fault.hits == 1
    assert scaling_cluster.get(DEPLOYMENTS, NS, "decode")["spec"]["replicas"] == 2


def test_missing_target_and_missing_role(scaling_cluster: ScalingCluster) -> None:
    scaling_cluster.add(STORMSERVICES, NS, storm_service("llm", 2, 4))
    s = scaler(scaling_cluster)
    with pytest.raises(ScalingError, match="not found"):
        s.replicas(ScaleTarget("decode", "Deployment", "nope", NS))
    with pytest.raises(ScalingError, match="no role 'router'"):
        s.scale(ScaleTarget("router", "StormService", "llm", NS), 2)


async def test_async_ready_replicas_with_retry(scaling_cluster: ScalingCluster) -> None:
    from kubernetes_asyncio import config

    scaling_cluster.add(STORMSERVICES, NS, storm_service("llm", 2, 4, {"prefill": 1, "decode": 4}))
    scaling_cluster.add(STATEFULSETS, NS, workload("StatefulSet", "decode", 4, 3))
    fault = scaling_cluster.api.fail("GET", r"/stormservices/llm$", 503, times=1)

    async def no_sleep(_: float) -> None:
        return None

    api = await config.new_client_from_config(config_file=str(scaling_cluster.kubeconfig))
    async with api:
        assert await ready_replicas_async(api, ScaleTarget("prefill", "StormService", "llm", NS),
                                          sleep=no_sleep) == RoleReplicas(2, 1)
        assert fault.hits == 1
        assert await ready_replicas_async(api, ScaleTarget("decode", "StatefulSet", "decode", NS)) == \
            RoleReplicas(4, 3)
        scaling_cluster.api.fail("GET", r"/statefulsets/decode$", 403)
        with pytest.raises(ScalingError, match="forbidden"):
            await ready_replicas_async(api, ScaleTarget("decode", "StatefulSet", "decode", NS))


PODGROUPS = "/apis/scheduling.x-k8s.io/v1alpha1/podgroups"


def plain_overlay_into(cluster: ScalingCluster) -> None:
    """The plain overlay's own StatefulSets and PodGroups (rendered with the pinned kubectl)."""
    from tests.unit.test_k8s_manifests import render

    for doc in render("plain"):
        if doc["kind"] == "StatefulSet":  # as the API server returns it before the controller acts
            cluster.add(STATEFULSETS, NS, {**doc, "status": {"replicas": 0, "availableReplicas": 0}})
        elif doc["kind"] == "PodGroup":
            cluster.add(PODGROUPS, NS, doc)


def set_ready(cluster: ScalingCluster, name: str, ready: int) -> None:
    """What the StatefulSet controller reports: its pods, and how many of them are Ready."""
    def change(o):
        o["status"] = {**o["status"], "replicas": o["spec"]["replicas"], "readyReplicas": ready}
        return o

    cluster.store.update(STATEFULSETS, NS, name, change)


def group_replicas(cluster: ScalingCluster, role: str) -> list[int]:
    return [cluster.get(STATEFULSETS, NS, f"{role}-g{i}")["spec"]["replicas"] for i in range(4)]


@pytest.mark.service
def test_plain_overlay_scales_by_whole_groups(scaling_cluster: ScalingCluster) -> None:
    plain_overlay_into(scaling_cluster)
    s = scaler(scaling_cluster)
    decode = ScaleTarget("decode", "StatefulSetGroups", "decode", NS, group_size=2)
    assert s.replicas(decode) == RoleReplicas(2, 0)
    set_ready(scaling_cluster, "decode-g0", 2)
    assert s.replicas(decode) == RoleReplicas(2, 2)

    assert s.scale(decode, 6) == 2  # g1 and g2 switched on, through their scale subresource
    assert group_replicas(scaling_cluster, "decode") == [2, 2, 2, 0]
    assert group_replicas(scaling_cluster, "prefill") == [2, 0, 0, 0]  # the other role untouched
    set_ready(scaling_cluster, "decode-g1", 1)  # one rank short: serves nothing
    assert s.replicas(decode) == RoleReplicas(6, 2)
    patches = [p for m, p in scaling_cluster.store.requests if m == "PATCH"]
    assert patches == [f"/apis/apps/v1/namespaces/{NS}/statefulsets/decode-g{i}/scale" for i in (1, 2)]

    assert s.scale(decode, 2) == 6  # highest groups off first; g0 stays
    assert group_replicas(scaling_cluster, "decode") == [2, 0, 0, 0]
    assert s.scale(decode, 0) == 2
    assert group_replicas(scaling_cluster, "decode") == [0, 0, 0, 0]
    assert s.scale(decode, 8) == 0
    assert group_replicas(scaling_cluster, "decode") == [2, 2, 2, 2]


@pytest.mark.service
def test_plain_overlay_refuses_what_would_break_a_gang(scaling_cluster: ScalingCluster) -> None:
    plain_overlay_into(scaling_cluster)
    s = scaler(scaling_cluster)
    prefill = ScaleTarget("prefill", "StatefulSetGroups", "prefill", NS, group_size=2)
    with pytest.raises(ScalingError, match="not whole groups of 2"):
        s.scale(prefill, 3)
    with pytest.raises(ScalingError, match="need 5 groups, the namespace declares 4"):
        s.scale(prefill, 10)
    # The policy's gang_size disagrees with the overlay's PodGroups: nothing is switched on.
    wrong = ScaleTarget("prefill", "StatefulSetGroups", "prefill", NS, group_size=4)
    with pytest.raises(ScalingError, match="has 2 replicas: a prefill group is 0 or 4 pods"):
        s.scale(wrong, 8)

    def min_member(o):
        o["spec"]["minMember"] = 4
        return o

    scaling_cluster.store.update(PODGROUPS, NS, "prefill-g1", min_member)
    with pytest.raises(ScalingError, match="podgroup/prefill-g1 minMember 4 != the prefill group size 2"):
        s.scale(prefill, 4)
    scaling_cluster.store.remove(PODGROUPS, NS, "prefill-g1")
    with pytest.raises(ScalingError, match="no PodGroup 'prefill-g1'"):
        s.scale(prefill, 4)
    assert group_replicas(scaling_cluster, "prefill") == [2, 0, 0, 0]
    with pytest.raises(ScalingError, match="no StatefulSets router-g<N>"):
        s.replicas(ScaleTarget("router", "StatefulSetGroups", "router", NS))


@pytest.mark.service
async def test_async_ready_replicas_of_groups(scaling_cluster: ScalingCluster) -> None:
    from kubernetes_asyncio import config

    plain_overlay_into(scaling_cluster)
    set_ready(scaling_cluster, "prefill-g0", 2)
    api = await config.new_client_from_config(config_file=str(scaling_cluster.kubeconfig))
    async with api:
        target = ScaleTarget("prefill", "StatefulSetGroups", "prefill", NS, group_size=2)
        assert await ready_replicas_async(api, target) == RoleReplicas(2, 2)
