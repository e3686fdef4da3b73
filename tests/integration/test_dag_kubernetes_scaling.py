"""Kubernetes-mode batches with the serving roles scaled around them, on a running Airflow.

Why a running Airflow (api-server, scheduler, dag-processor, triggerer) and not
``airflow dags test``: dags test runs one task at a time and a deferred task's trigger
inline, so the autoscale sensor could never run *beside* the dispatch tasks there (it
would tick alone until the completion window ends). Here a real triggerer runs the
``AutoscaleTickTrigger`` next to the dispatch pods' triggers.

The Kubernetes API double (with the ``scale`` subresource) and the fake kubelet run in
this process; the roles are a StormService ``llm`` (the aibrix overlay's shape) and each
role's "pod" runs on another node with the real vLLM CPU server as its ``/metrics``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import pytest

from aibrix_operators.local_airflow import AirflowDeployment, start_airflow, trigger_and_wait
from tests.integration.conftest import SERVED_NAME, TEST_BUCKET, chat_requests
from tests.k8s_double import FakeCluster, Image
from tests.k8s_double.fixtures import driver_container_image
from tests.scaling.k8s_scaling_double import STORMSERVICES, ScalingApiDouble, storm_service
from tests.scaling.vllm_pods import role_pod

pytestmark = [pytest.mark.e2e, pytest.mark.double_only(
    "scales StormServices and serves vLLM pods through the scaling double")]

NS = "batch"
# The deployment's scaling settings: both roles start at 2, must be at least 4 while a batch
# runs (min_replicas), and go to 0 after it.
ROLES = {
    role: {"kind": "StormService", "name": "llm", "min_replicas": 4, "max_replicas": 8, "gang_size": 2,
           "nominal_tokens_per_s": 1e6, "startup_s": 0, "tail_s": 0, "idle_replicas": 0}
    for role in ("prefill", "decode")
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, s3_server, vllm_chat) -> Iterator[FakeCluster]:
    # Driver pods run as podman containers of the batch-driver image built from this checkout.
    image = driver_container_image()
    with FakeCluster(
        tmp_path_factory.mktemp("k8s-scaling"), images={image: Image(container=image)}, api=ScalingApiDouble()
    ) as c:
        c.add_secret(NS, "aibrix-batch-s3", {**s3_server.env()})
        c.add_secret(NS, "aibrix-batch-inference", {"OPENAI_API_KEY": "sk-scaling-test",
                                                    "OPENAI_API_KEY_ORIGIN": vllm_chat.base_url})
        yield c


@pytest.fixture(scope="module")
def airflow(airflow_session_env, tmp_path_factory, cluster, s3_server) -> Iterator[AirflowDeployment]:
    s3_server.ensure_bucket(TEST_BUCKET)
    home = tmp_path_factory.mktemp("airflow-k8s-scaling")
    conn = s3_server.airflow_connection()
    env = {
        **airflow_session_env,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW_CONN_BATCH_S3": json.dumps(conn),
        "AIRFLOW_CONN_KUBERNETES_DEFAULT": cluster.airflow_connection(NS),
        "AIRFLOW__AIBRIX_BATCH__KUBERNETES_NAMESPACE": NS,
        "AIRFLOW__AIBRIX_BATCH__DRIVER_IMAGE": driver_container_image(),
        "AIRFLOW__AIBRIX_BATCH__DRIVER_POLL_INTERVAL_S": "0.5",
        "AIRFLOW__AIBRIX_SCALING__ROLES": json.dumps(ROLES),
        "AIRFLOW__AIBRIX_SCALING__NAMESPACE": NS,
        "AIRFLOW__AIBRIX_SCALING__INTERVAL_S": "10",  # MIN_INTERVAL_S
    }
    with start_airflow(env, home) as deployment:
        yield deployment


def fresh_roles(cluster: FakeCluster, vllm_base_url: str) -> None:
    """The StormService at 2 + 2 ready replicas, and one Ready pod per role whose /metrics are
    the real vLLM server's (on another node: the fake kubelet leaves it alone)."""
    cluster.store.remove(STORMSERVICES, NS, "llm")
    cluster.store.create(STORMSERVICES, NS, storm_service("llm", 2, 2, {"prefill": 2, "decode": 2}))
    port = urlsplit(vllm_base_url).port
    assert port
    for role in ("prefill", "decode"):
        cluster.store.remove("/api/v1/pods", NS, f"llm-{role}-0")
        cluster.store.create("/api/v1/pods", NS, role_pod(f"llm-{role}-0", role, port))


def role_replicas_history(cluster: FakeCluster) -> list[dict[str, int]]:
    """Each distinct (prefill, decode) replicas of the StormService since it was last created."""
    out: list[dict[str, int]] = []
    for _, event, key, obj in cluster.store._history:
        if key[0] != STORMSERVICES or key[2] != "llm" or event == "DELETED":
            continue
        if event == "ADDED":
            out = []
        now = {r["name"]: r["replicas"] for r in obj["spec"]["template"]["spec"]["roles"]}
        if not out or out[-1] != now:
            out.append(now)
    return out


def run_batch(airflow: AirflowDeployment, s3_server, vllm_chat, name: str, n: int) -> dict:
    body = "".join(json.dumps(r) + "\n" for r in chat_requests(n)).encode()
    s3_server.client().put_object(Bucket=TEST_BUCKET, Key=f"k8s-scaling/{name}/in.jsonl", Body=body)
    return trigger_and_wait(airflow, "batch_inference", {
        "input_uri": f"s3://{TEST_BUCKET}/k8s-scaling/{name}/in.jsonl",
        "output_uri": f"s3://{TEST_BUCKET}/k8s-scaling/{name}/out",
        "endpoint": vllm_chat.base_url, "aws_conn_id": "batch_s3", "model": SERVED_NAME,
        "execution_mode": "kubernetes", "requests_per_shard": 2,
    }, timeout_s=600)


def task_states(airflow: AirflowDeployment, run_id: str) -> dict[str, list[str]]:
    tis = airflow.api("GET", f"/api/v2/dags/batch_inference/dagRuns/{run_id}/taskInstances")
    out: dict[str, list[str]] = {}
    for ti in tis["task_instances"]:
        out.setdefault(ti["task_id"], []).append(ti["state"])
    return out


def xcom(airflow: AirflowDeployment, run_id: str, task: str, key: str = "return_value") -> object:
    entry = airflow.api(
        "GET", f"/api/v2/dags/batch_inference/dagRuns/{run_id}/taskInstances/{task}/xcomEntries/{key}")
    value = entry["value"]
    return json.loads(value) if isinstance(value, str) else value


@contextmanager
def drivers_pending_until_autoscale_decided(airflow: AirflowDeployment, cluster: FakeCluster,
                                            timeout_s: float = 300) -> Iterator[None]:
    """Keep the driver pods Pending (Unschedulable, as on a cluster still adding nodes) until
    the autoscale task has pushed its first decisions.

    Four tiny requests answer in about a second: on a loaded worker the scheduler can start
    the autoscale task after both shards are done, and it then rightly ends without a
    decision (the CI run of ff8e360 did). Holding the drivers makes "beside dispatch" sure.
    """
    assert cluster.kubelet
    cluster.kubelet.schedulable = False
    stop = threading.Event()

    def release() -> None:
        deadline = time.monotonic() + timeout_s
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                runs = airflow.api("GET", "/api/v2/dags/batch_inference/dagRuns?order_by=-start_date&limit=1")
                for run in runs["dag_runs"]:
                    try:
                        xcom(airflow, run["dag_run_id"], "autoscale", "scaling_decisions")
                        return
                    except AssertionError:
                        pass  # 404 until the first tick has run
                stop.wait(1)
        finally:
            cluster.kubelet.schedulable = True

    releaser = threading.Thread(target=release, name="release-drivers", daemon=True)
    releaser.start()
    try:
        yield
    finally:
        stop.set()
        releaser.join(timeout=30)
        cluster.kubelet.schedulable = True


def test_roles_scale_up_beside_dispatch_and_down_after_merge(airflow, cluster, s3_server, vllm_chat) -> None:
    fresh_roles(cluster, vllm_chat.base_url)
    n_requests = len(cluster.store.requests)
    with drivers_pending_until_autoscale_decided(airflow, cluster):
        run = run_batch(airflow, s3_server, vllm_chat, "ok", 4)
    assert run["state"] == "success", airflow.failure_report("batch_inference", run["dag_run_id"])
    run_id = run["dag_run_id"]
    states = task_states(airflow, run_id)
    assert states["roles_ready"] == ["success"] and states["autoscale"] == ["success"]
    assert states["dispatch"] == ["success", "success"] and states["scale_down"] == ["success"]
    # One pod per shard, each a container of the built driver image. Airflow may retry a dispatch
    # it lost track of (a deferral racing the executor's report: a clean-clone run did); the retry
    # is another pod that resumes from the checkpoints, so count shards, not pods.
    drivers = cluster.kubelet.all_runs()
    assert drivers and all(r.container_name for r in drivers), drivers
    last = {r.labels["aibrix.ai/shard-index"]: r for r in drivers}
    assert sorted(last) == ["0", "1"] and all(r.exit_code == 0 for r in last.values()), drivers
    # Up to the floor (4) before dispatch, through the StormService's role replicas; down to
    # idle (0) after merge. Every change is one PATCH of the StormService.
    assert role_replicas_history(cluster) == [
        {"prefill": 2, "decode": 2}, {"prefill": 4, "decode": 2}, {"prefill": 4, "decode": 4},
        {"prefill": 0, "decode": 4}, {"prefill": 0, "decode": 0}]
    patches = [p for m, p in cluster.store.requests[n_requests:] if m == "PATCH" and "/stormservices/" in p]
    assert patches == [f"/apis/orchestration.aibrix.ai/v1alpha1/namespaces/{NS}/stormservices/llm"] * 4
    assert xcom(airflow, run_id, "autoscale") == {"ended": "every shard is done", "answered": 4, "total": 4}
    # The autoscaler's decisions saw the roles' pods: it listed them by role and read the
    # real vLLM server's gauges (idle between the tiny shards, but present in every input).
    listed = [p for m, p in cluster.store.requests[n_requests:]
              if m == "GET" and p.startswith(f"/api/v1/namespaces/{NS}/pods?") and "component%3Ddecode" in p]
    assert listed, "the autoscale trigger never listed the decode pods"
    decisions = xcom(airflow, run_id, "autoscale", "scaling_decisions")
    assert set(decisions) == {"prefill", "decode"}
    for role, ds in decisions.items():
        assert ds and all(d["desired_replicas"] == 4 for d in ds), (role, ds)
        assert {"running", "waiting", "kv_usage"} <= set(ds[-1]["inputs"])


def test_autoscale_ends_when_a_shard_failed_for_good(airflow, cluster, s3_server, vllm_chat) -> None:
    """One shard's pod creation is forbidden (not retried): its answers never come, yet the
    autoscaler ends once every dispatch task has finished, and scale_down (all_done) runs."""
    fresh_roles(cluster, vllm_chat.base_url)
    earlier = len(cluster.kubelet.all_runs())
    cluster.api.clear_faults()
    cluster.api.fail("POST", rf"/namespaces/{NS}/pods$", 403, times=1, message="pods is forbidden")
    run = run_batch(airflow, s3_server, vllm_chat, "half", 4)
    assert run["state"] == "failed"
    run_id = run["dag_run_id"]
    states = task_states(airflow, run_id)
    assert sorted(states["dispatch"]) == ["failed", "success"]
    ran = cluster.kubelet.all_runs()[earlier:]  # the other shard's pod (or its retries), as containers
    assert ran and all(r.container_name for r in ran) and ran[-1].exit_code == 0, ran
    assert {r.labels["aibrix.ai/shard-index"] for r in ran} == {ran[-1].labels["aibrix.ai/shard-index"]}
    assert states["autoscale"] == ["success"] and states["scale_down"] == ["success"]
    ended = xcom(airflow, run_id, "autoscale")
    assert ended["ended"] == "every dispatch task has finished (1 of 2 failed)", ended
    assert ended["answered"] == 2 and ended["total"] == 4
    history = role_replicas_history(cluster)
    assert history[0] == {"prefill": 2, "decode": 2} and {"prefill": 4, "decode": 4} in history
    assert history[-1] == {"prefill": 0, "decode": 0}
