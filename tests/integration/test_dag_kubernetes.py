"""``execution_mode=kubernetes`` end to end: the real dispatch code (the provider's KubernetesHook,
PodManager and KubernetesPodTrigger), a Kubernetes API double at the HTTP boundary, a fake kubelet
running the driver CLI, real vLLM and SeaweedFS.

``airflow dags test`` runs the DAG in a subprocess; the API double and the kubelet run in
this process (tests/k8s_double), so tests can kill, delete and fault what the DAG sees.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from tests.integration.conftest import SERVED_NAME, TEST_BUCKET, chat_requests, dags_test, read_jsonl
from tests.integration.gate_proxy import GateProxy
from tests.k8s_double import FakeCluster, Image
from tests.k8s_double.fixtures import driver_container_image

pytestmark = [pytest.mark.e2e, pytest.mark.waits, pytest.mark.double_only(
    "kills, deletes and faults pods through the double's kubelet and API")]

NS = "batch"
PLANTED = "sk-planted-k8s-3b9d27e1c4"  # the inference Secret's key: must never leave the Secret


@pytest.fixture(scope="module")
def bucket(s3_server) -> str:
    s3_server.ensure_bucket(TEST_BUCKET)
    return TEST_BUCKET


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, s3_server, vllm_chat) -> Iterator[FakeCluster]:
    # Driver pods run as podman containers of the batch-driver image built from this checkout.
    image = driver_container_image()
    with FakeCluster(tmp_path_factory.mktemp("k8s"), images={image: Image(container=image)}) as c:
        c.add_secret(NS, "aibrix-batch-s3", {**s3_server.env()})
        c.add_secret(
            NS,
            "aibrix-batch-inference",
            {"OPENAI_API_KEY": PLANTED, "OPENAI_API_KEY_ORIGIN": vllm_chat.base_url},
        )
        yield c


@pytest.fixture
def k8s_env(airflow_session_env, cluster, s3_server) -> dict[str, str]:
    cluster.api.clear_faults()
    conn = s3_server.airflow_connection()
    return {
        **airflow_session_env,
        "AIRFLOW_CONN_BATCH_S3": json.dumps(conn),  # validate/split/merge; pods use the S3 Secret
        "AIRFLOW_CONN_KUBERNETES_DEFAULT": cluster.airflow_connection(NS),
        "AIRFLOW__AIBRIX_BATCH__KUBERNETES_NAMESPACE": NS,
        "AIRFLOW__AIBRIX_BATCH__DRIVER_IMAGE": driver_container_image(),
        "AIRFLOW__AIBRIX_BATCH__DRIVER_POLL_INTERVAL_S": "0.5",
    }


def conf(bucket: str, name: str, endpoint: str, **extra) -> dict:
    return {
        "input_uri": f"s3://{bucket}/k8s/{name}/in.jsonl",
        "output_uri": f"s3://{bucket}/k8s/{name}/out",
        "endpoint": endpoint,
        "aws_conn_id": "batch_s3",
        "model": SERVED_NAME,
        "execution_mode": "kubernetes",
        **extra,
    }


def put_input(s3_server, bucket: str, name: str, requests: list[dict]) -> None:
    body = "".join(json.dumps(r) + "\n" for r in requests).encode()
    s3_server.client().put_object(Bucket=bucket, Key=f"k8s/{name}/in.jsonl", Body=body)


def get(s3_server, bucket: str, key: str) -> str:
    return s3_server.client().get_object(Bucket=bucket, Key=key)["Body"].read().decode()


def runs_of(cluster: FakeCluster, batch_id: str) -> list:
    return [r for r in cluster.kubelet.all_runs() if r.labels.get("aibrix.ai/batch-id") == batch_id]


def test_batch_runs_in_driver_pods_through_api_faults(
    k8s_env, cluster, s3_server, bucket, vllm_chat, tmp_path
):
    requests = chat_requests(24)
    put_input(s3_server, bucket, "e2e", requests)
    # Faults the provider must ride out: a conflict on create and a 500 on a pod read (its
    # API retry), and event watches that never send anything (the trigger polls the pod).
    conflict = cluster.api.fail("POST", rf"/namespaces/{NS}/pods$", 409)
    error = cluster.api.fail("GET", rf"/namespaces/{NS}/pods/aibrix-driver-[^/]+$", 500)
    cluster.api.stall_watches(r"/events\?.*watch=true")
    # memory_per_job (the job pool's, docs/job-pool.md) sizes every driver pod of the batch.
    proc = dags_test(k8s_env, conf(bucket, "e2e", vllm_chat.base_url, requests_per_shard=8,
                                   memory_per_job="768Mi"), tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert conflict.hits == 1 and error.hits == 1

    output = read_jsonl(get(s3_server, bucket, "k8s/e2e/out/output.jsonl"))
    assert [r["custom_id"] for r in output] == [r["custom_id"] for r in requests]
    assert all(r["response"]["status_code"] == 200 for r in output)
    batch = json.loads(get(s3_server, bucket, "k8s/e2e/out/batch.json"))
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 24, "completed": 24, "failed": 0}

    runs = runs_of(cluster, batch["id"])
    assert sorted(r.labels["aibrix.ai/shard-index"] for r in runs) == ["0", "1", "2"]
    assert {r.labels["aibrix.ai/attempt"] for r in runs} == {"1"} and {r.exit_code for r in runs} == {0}
    assert all(r.container_name for r in runs)  # 3 pods, each a container of the built driver image
    run = runs[0]
    assert run.argv[1:3] == ["-m", "aibrix_operators.driver.cli"]
    (config,) = [a.removeprefix("--config-json=") for a in run.argv if a.startswith("--config-json=")]
    assert json.loads(config)["endpoint"] == vllm_chat.base_url  # the worker's DriverConfig, as itself
    assert {"AWS_SECRET_ACCESS_KEY", "OPENAI_API_KEY", "OPENAI_API_KEY_ORIGIN"} <= set(run.env_names)
    assert all(r.labels.get("dag_id") == "batch_inference" and r.labels.get("map_index") for r in runs)
    assert cluster.pods(NS) == []  # finished pods are deleted

    # The planted key and the S3 secret are nowhere but in their Secrets.
    pod_history = [o for _, _, key, o in cluster.store._history if key[0] == "/api/v1/pods"]
    assert pod_history and "aibrix-batch-inference" in json.dumps(pod_history)
    resources = [c["resources"] for o in pod_history if isinstance(o, dict)
                 for c in o.get("spec", {}).get("containers", [])]
    assert resources and all(r["requests"]["memory"] == r["limits"]["memory"] == "768Mi"
                             for r in resources), resources
    logs = [cluster.store.log_lines(NS, r.name)[0] for r in runs]
    for secret in (PLANTED, s3_server.secret_key):
        assert secret not in json.dumps(pod_history)
        assert not any(secret in " ".join(r.argv) for r in runs)
        assert not any(secret in line.text for lines in logs for line in lines)
        assert secret not in proc.stdout + proc.stderr
    for line in ("k8s/e2e/out/output.jsonl", "k8s/e2e/out/batch.json"):
        assert PLANTED not in get(s3_server, bucket, line)
    home = Path(k8s_env["AIRFLOW_HOME"])
    assert not [p for p in home.rglob("*") if p.is_file() and PLANTED.encode() in p.read_bytes()]


def test_pod_killed_or_deleted_mid_shard_is_retried_and_resumes(
    k8s_env, cluster, s3_server, bucket, vllm_chat, tmp_path
):
    requests = chat_requests(40, max_tokens=128)  # slow enough to be caught mid-shard
    put_input(s3_server, bucket, "kill", requests)
    api = client.CoreV1Api(config.new_client_from_config(str(cluster.kubeconfig)))
    s3 = s3_server.client()
    done: dict[str, str] = {}
    stop = threading.Event()

    def segments(shard: int) -> int:
        listing = s3.list_objects_v2(Bucket=bucket, Prefix="k8s/kill/out/_work/").get("Contents", [])
        return sum(f"/results/shard-{shard:05d}/" in o["Key"] and "/seg-" in o["Key"] for o in listing)

    def chaos(gate: GateProxy) -> None:
        # Shard 0's first pod is killed (exit 137), shard 1's first pod is deleted through the
        # API, each once it has checkpointed some answers and while it is still sending. A tiny
        # model can answer a whole shard within one checkpoint interval (a clean-clone run of
        # 9385862 lost that race), so the gate lets a new pod send five requests and holds the
        # next: the pod is then provably mid-shard. `dags test` may run either shard first (a
        # clean-clone run of e029e9f ran shard 1 first), so both are watched at once.
        actions = {0: "kill", 1: "delete"}
        armed: dict[str, float] = {}  # pod name -> when the gate was last armed for it
        while not stop.is_set() and len(done) < len(actions):
            for shard, action in actions.items():
                if str(shard) in done:
                    continue
                pods = [
                    r
                    for r in cluster.kubelet.running(NS)
                    if r.labels.get("aibrix.ai/shard-index") == str(shard)
                ]
                if not pods:
                    continue
                pod = pods[0]
                if pod.name not in armed:
                    armed[pod.name] = time.monotonic()
                    gate.hold_after(5)
                elif gate.held and segments(shard) >= 1:
                    if action == "kill":
                        cluster.kubelet.kill(NS, pod.name)
                    else:
                        api.delete_namespaced_pod(pod.name, NS)
                    done[str(shard)] = pod.name
                    gate.release()
                elif gate.held and time.monotonic() - armed[pod.name] > 5:
                    # The other shard's pod took the five: let five more through.
                    armed[pod.name] = time.monotonic()
                    gate.hold_after(5)
            stop.wait(0.1)

    with GateProxy(vllm_chat.base_url) as gate:
        watcher = threading.Thread(target=chaos, args=(gate,), daemon=True)
        watcher.start()
        try:
            proc = dags_test(
                k8s_env, conf(bucket, "kill", gate.base_url, requests_per_shard=20, concurrency=1),
                tmp_path,
            )  # fmt: skip
        finally:
            stop.set()
            watcher.join(5)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert set(done) == {"0", "1"}, f"the chaos thread did not hit both shards: {done}"

    output = read_jsonl(get(s3_server, bucket, "k8s/kill/out/output.jsonl"))
    assert [r["custom_id"] for r in output] == [r["custom_id"] for r in requests]  # each once, in order
    assert get(s3_server, bucket, "k8s/kill/out/errors.jsonl") == ""
    batch = json.loads(get(s3_server, bucket, "k8s/kill/out/batch.json"))
    assert batch["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    runs = runs_of(cluster, batch["id"])
    for shard in ("0", "1"):
        attempts = sorted(
            (r.labels["aibrix.ai/attempt"], r.exit_code)
            for r in runs
            if r.labels["aibrix.ai/shard-index"] == shard
        )
        assert [a for a, _ in attempts] == ["1", "2"], attempts
        assert attempts[0][1] != 0 and attempts[1][1] == 0
    assert len(runs) == 4 and all(r.container_name for r in runs)  # 2 shards x 2 attempts, as containers
    # The deleted pod's driver (PID 1 of its container) took its SIGTERM and exited on it.
    deleted = [r for r in runs if r.name == done["1"]]
    assert [r.exit_code for r in deleted] == [143], deleted
    # The retries resumed: the second pod of each shard skipped what the first had checkpointed.
    killed_log = [
        ln.text
        for r in runs
        if r.labels["aibrix.ai/attempt"] == "2"
        for ln in cluster.store.log_lines(NS, r.name)[0]
    ]
    outcomes = [json.loads(t) for t in killed_log if t.startswith("{") and '"resumed' in t]
    assert len(outcomes) == 2 and all(o["resumed"] > 0 and o["completed"] < 20 for o in outcomes), outcomes


def test_forbidden_and_unpullable_image_fail_at_once_with_specific_errors(
    k8s_env, cluster, s3_server, bucket, vllm_chat, tmp_path
):
    put_input(s3_server, bucket, "denied", chat_requests(3))
    cluster.api.fail(
        "POST", rf"/namespaces/{NS}/pods$", 403, times=100, message="pods is forbidden: no create"
    )
    proc = dags_test(k8s_env, conf(bucket, "denied", vllm_chat.base_url), tmp_path / "denied")
    assert proc.returncode != 0
    batch = json.loads(get(s3_server, bucket, "k8s/denied/out/batch.json"))
    assert batch["status"] == "failed"
    [err] = batch["errors"]["data"]
    assert err["code"] == "kubernetes_forbidden" and "403" in err["message"], err
    assert proc.stdout.count("[DAG TEST] starting task_id=dispatch") == 1  # not retried
    cluster.api.clear_faults()

    put_input(s3_server, bucket, "image", chat_requests(3))
    env = {**k8s_env, "AIRFLOW__AIBRIX_BATCH__DRIVER_IMAGE": "registry.invalid/batch-driver:nope"}
    proc = dags_test(env, conf(bucket, "image", vllm_chat.base_url), tmp_path / "image")
    assert proc.returncode != 0
    [err] = json.loads(get(s3_server, bucket, "k8s/image/out/batch.json"))["errors"]["data"]
    assert err["code"] == "driver_image_pull_failed", err
    assert "registry.invalid/batch-driver:nope" in err["message"]
    assert proc.stdout.count("[DAG TEST] starting task_id=dispatch") == 1
