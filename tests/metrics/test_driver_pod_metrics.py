"""Driver pods expose their metrics: the spec declares the port and the prometheus.io annotations
and passes the Pushgateway; a pod run by the fake kubelet serves /metrics while it runs and pushes
its totals when it ends."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client import ApiClient

from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver_pods.spec import DriverPodRequest, DriverPodSettings, build_driver_pod
from aibrix_operators.serving.local_vllm import free_port
from tests.k8s_double.fixtures import LOCAL_PYTHON_IMAGE, process_cluster  # noqa: F401 - fixture
from tests.metrics.conftest import REPO

NOW = 1_800_000_000.0
REQ = DriverPodRequest(batch_id="batch_0a750e3a913c42cf", shard_index=0, shard_uri="s3://b/shard-00000.jsonl",
                       results_prefix="s3://b/results/shard-00000", total_requests=10, attempt=1,
                       config=DriverConfig(endpoint="http://router:8000", deadline=NOW + 3600))


def _env(manifest: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in manifest["spec"]["containers"][0]["env"]}


def test_spec_declares_the_metrics_port_annotations_and_pushgateway():
    settings = DriverPodSettings(pushgateway_url="http://pushgateway.monitoring:9091")
    m = build_driver_pod(settings, REQ, now=NOW).manifest()
    c = m["spec"]["containers"][0]
    assert c["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
    notes = m["metadata"]["annotations"]
    assert (notes["prometheus.io/scrape"], notes["prometheus.io/port"], notes["prometheus.io/path"]) == (
        "true", "9400", "/metrics")
    env = _env(m)
    # on the pod's own IP (the default 127.0.0.1 would hide it from Prometheus)
    assert env["AIBRIX_DRIVER_METRICS_PORT"] == "9400" and env["AIBRIX_DRIVER_METRICS_ADDR"] == "0.0.0.0"
    assert env["AIBRIX_PUSHGATEWAY_URL"] == "http://pushgateway.monitoring:9091"
    import kubernetes_validate

    m["metadata"]["name"] += "-abcd1234"
    kubernetes_validate.validate(m, "1.33", strict=True)


def test_metrics_port_zero_and_no_pushgateway_leave_the_pod_without_them():
    m = build_driver_pod(DriverPodSettings(metrics_port=0), REQ, now=NOW).manifest()
    assert "ports" not in m["spec"]["containers"][0]
    assert not any(k.startswith("prometheus.io/") for k in m["metadata"]["annotations"])
    assert not {"AIBRIX_DRIVER_METRICS_PORT", "AIBRIX_PUSHGATEWAY_URL"} & set(_env(m))


def test_settings_from_airflow_config(monkeypatch):
    from aibrix_operators.settings.driver_pods import load_driver_pod_settings

    monkeypatch.setenv("AIRFLOW__AIBRIX_BATCH__DRIVER_METRICS_PORT", "9500")
    monkeypatch.setenv("AIRFLOW__AIBRIX_BATCH__DRIVER_PUSHGATEWAY_URL", "http://pgw:9091")
    s = load_driver_pod_settings()
    assert (s.metrics_port, s.pushgateway_url) == (9500, "http://pgw:9091")
    monkeypatch.setenv("AIRFLOW__AIBRIX_BATCH__DRIVER_PUSHGATEWAY_URL", "")
    assert load_driver_pod_settings().pushgateway_url is None


def test_provider_pod_carries_the_port():
    from aibrix_operators.operators.driver_pod import DriverPodRunner

    settings = DriverPodSettings()
    runner = DriverPodRunner(pod=build_driver_pod(settings, REQ, now=NOW), settings=settings)
    pod = ApiClient().sanitize_for_serialization(runner.pod_request(context=None))
    assert pod["spec"]["containers"][0]["ports"] == [{"name": "metrics", "containerPort": 9400,
                                                      "protocol": "TCP"}]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9400"


def test_podmonitor_selects_driver_pods_by_their_labels_and_port():
    """monitoring/kubernetes/driver-podmonitor.yaml (Prometheus Operator): it must select what the
    spec labels, on the port the spec names, and copy the batch id onto the series."""
    pm = yaml.safe_load((REPO / "monitoring" / "kubernetes" / "driver-podmonitor.yaml").read_text())
    assert pm["kind"] == "PodMonitor" and pm["apiVersion"] == "monitoring.coreos.com/v1"
    labels = build_driver_pod(DriverPodSettings(), REQ, now=NOW).labels
    match = pm["spec"]["selector"]["matchLabels"]
    assert match and all(labels.get(k) == v for k, v in match.items())
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert "aibrix.ai/batch-id" in pm["spec"]["podTargetLabels"]


@pytest.mark.service
def test_driver_pod_serves_and_pushes_its_metrics(tmp_path, process_cluster, fault_server,  # noqa: F811
                                                  make_request, pushgateway):
    # Process mode: the shard is a local file, and the double does not model volumes. The driver
    # image runs real shards in tests/images and tests/integration/test_dag_kubernetes*.py.
    fake_cluster = process_cluster
    port = free_port()  # the fake kubelet runs pods on this host's network: no fixed port
    shard = tmp_path / "shard-00000.jsonl"
    shard.write_text("".join(json.dumps(make_request(f"s{i}", "slow:0.2")) + "\n" for i in range(30)))
    settings = DriverPodSettings(namespace="batch", image=LOCAL_PYTHON_IMAGE, s3_secret=None,
                                 inference_secret=None, metrics_port=port, pushgateway_url=pushgateway)
    req = DriverPodRequest(batch_id="batch_metrics", shard_index=0, shard_uri=str(shard),
                           results_prefix=str(tmp_path / "results"), total_requests=30, attempt=1,
                           config=DriverConfig(endpoint=fault_server.url, deadline=time.time() + 600,
                                               concurrency=2), model="m")
    manifest = build_driver_pod(settings, req).manifest()
    manifest["metadata"]["name"] += "-m1"
    api = client.CoreV1Api(config.new_client_from_config(str(fake_cluster.kubeconfig)))
    api.create_namespaced_pod("batch", manifest)

    def scrape() -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as resp:
                return resp.read().decode()
        except OSError:
            return None

    # ~3 s of slow requests at concurrency 2: the running driver answers a scrape on the pod's port
    live = fake_cluster.wait_for(lambda: (t := scrape()) and "aibrix_driver_shards_running 1.0" in t and t,
                                 30, "the driver pod's /metrics", interval=0.1)
    assert "aibrix_driver_requests_in_flight" in live
    pod = fake_cluster.wait_for(
        lambda: (p := api.read_namespaced_pod(manifest["metadata"]["name"], "batch")).status.phase
        in ("Succeeded", "Failed") and p, 60, "the driver pod to end")
    logs = api.read_namespaced_pod_log(pod.metadata.name, "batch", _preload_content=False).data.decode()
    assert pod.status.phase == "Succeeded", logs[-3000:]
    with urllib.request.urlopen(pushgateway + "/metrics", timeout=5) as resp:
        pushed = [line for line in resp.read().decode().splitlines()
                  if line.startswith('aibrix_driver_requests_total{') and 'outcome="completed"' in line]
    assert len(pushed) == 1 and 'job="aibrix_driver"' in pushed[0], pushed
    assert float(pushed[0].rsplit(" ", 1)[1]) == 30  # the pod's own process: exactly its shard


@pytest.fixture(autouse=True)
def _no_worker_env(monkeypatch):
    monkeypatch.delenv("AIBRIX_PUSHGATEWAY_URL", raising=False)
