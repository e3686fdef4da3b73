"""The switch between the double and a real cluster (``target.py``), proven here with the double
standing in as the "real" server: a kubeconfig file the test writes (plain http on 127.0.0.1 and
the double's bearer token, which it checks) is read through the real-cluster path, which makes and
drops its own namespace; and what is deselected then, and why."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from tests.k8s_double.api import NAMESPACES
from tests.k8s_double.cluster import FakeCluster
from tests.k8s_double.fixtures import kube_target  # noqa: F401 - fixture
from tests.k8s_double.target import (
    ENV_IMAGE,
    ENV_KUBECONFIG,
    RealClusterPlugin,
    RealClusterSettings,
    open_target,
    real_cluster_settings,
)

IMAGE = "registry.example.com/aibrix-batch-driver:test"


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The double as "the cluster", K8S_TEST_KUBECONFIG naming a kubeconfig written for it."""
    with FakeCluster(tmp_path / "server", images={}, kubelet=False) as cluster:
        kubeconfig = tmp_path / "real-kubeconfig.yaml"  # YAML, as kubectl writes them
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "ci",
            "clusters": [{"name": "ci", "cluster": {"server": cluster.url}}],
            "users": [{"name": "tester", "user": {"token": cluster.api.token}}],
            "contexts": [{"name": "ci", "context": {"cluster": "ci", "user": "tester"}}],
        }))
        monkeypatch.setenv(ENV_KUBECONFIG, str(kubeconfig))
        monkeypatch.setenv(ENV_IMAGE, IMAGE)
        yield cluster


def namespaces(cluster: FakeCluster) -> list[str]:
    return [o["metadata"]["name"] for o in cluster.store.list(NAMESPACES)]


def test_the_fixture_is_the_cluster_the_kubeconfig_names(server: FakeCluster,
                                                          request: pytest.FixtureRequest) -> None:
    target = request.getfixturevalue("kube_target")
    assert not target.is_double and target.image == IMAGE and target.patience > 1
    assert namespaces(server) == [target.namespace] and target.namespace.startswith("aibrix-test-")
    assert ("POST", "/api/v1/namespaces") in server.store.requests  # through the kubeconfig's server


def test_a_real_target_makes_and_drops_its_namespace_and_our_code_reaches_it(
        server: FakeCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    with open_target(tmp_path) as target:
        ns = target.namespace
        assert not target.is_double and namespaces(server) == [ns]
        target.add_secret("s3", {"KEY": "v"})
        target.create("pods", {"metadata": {"name": "p"}, "spec": {
            "containers": [{"name": "base", "image": target.image}]}})
        assert [p["metadata"]["name"] for p in target.pods()] == ["p"] and target.running() == []
        assert target.get("secrets", "nope") is None
        # The product's path: an Airflow kubernetes connection whose kube_config_path is the file.
        monkeypatch.setenv("AIRFLOW_CONN_K8S_TARGET_TEST", target.airflow_connection())
        core = KubernetesHook(conn_id="k8s_target_test").core_v1_client
        assert [p.metadata.name for p in core.list_namespaced_pod(ns).items] == ["p"]
        # A real pod is ended through the API (its deadline), not by a kubelet we hold.
        target.end_pod("p")
        assert target.pod("p")["spec"]["activeDeadlineSeconds"] == 1
        # A quota's status as its controller writes it: the Pending pod counts.
        target.create("resourcequotas", {"metadata": {"name": "q"}, "spec": {"hard": {"pods": "2"}}})
        assert target.quota_counted("q", {"pods": "1"}) and not target.quota_counted("q", {"pods": "0"})
    assert namespaces(server) == [] and server.store.list("/api/v1/pods", ns) == []
    assert ("DELETE", f"/api/v1/namespaces/{ns}") in [(m, p.split("?")[0]) for m, p in server.store.requests]


def test_settings_say_what_to_set(tmp_path: Path) -> None:
    assert real_cluster_settings({}) is None  # the default: the double
    with pytest.raises(pytest.UsageError, match="no such file"):
        real_cluster_settings({ENV_KUBECONFIG: str(tmp_path / "missing")})
    (tmp_path / "kubeconfig").write_text("{}")
    with pytest.raises(pytest.UsageError, match=f"set {ENV_IMAGE} to the batch-driver image"):
        real_cluster_settings({ENV_KUBECONFIG: str(tmp_path / "kubeconfig")})
    assert real_cluster_settings({ENV_KUBECONFIG: str(tmp_path / "kubeconfig"), ENV_IMAGE: IMAGE}) == (
        RealClusterSettings(tmp_path / "kubeconfig", IMAGE))


def test_double_only_tests_are_deselected_saying_why(tmp_path: Path) -> None:
    def item(nodeid: str, marker: str | None = None, fixtures: tuple[str, ...] = ()) -> Any:
        mark = SimpleNamespace(args=(marker,)) if marker else None
        return SimpleNamespace(nodeid=nodeid, fixturenames=fixtures,
                               get_closest_marker=lambda name: mark if name == "double_only" else None)

    items = [item("a", fixtures=("kube_target",)), item("b", marker="injects faults"),
             item("c", fixtures=("tmp_path", "process_cluster")), item("d")]
    dropped: list[Any] = []
    config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: dropped.extend(items)))
    plugin = RealClusterPlugin(RealClusterSettings(tmp_path / "kubeconfig", IMAGE))
    plugin.pytest_collection_modifyitems(config, items)
    assert [i.nodeid for i in items] == ["a", "d"] and [i.nodeid for i in dropped] == ["b", "c"]
    report = plugin.pytest_report_collectionfinish(config, tmp_path, items)
    assert report[1:] == ["  b: injects faults",
                          "  c: fixture process_cluster: uses the double's store or kubelet directly"]
