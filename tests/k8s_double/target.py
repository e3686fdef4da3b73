"""The Kubernetes API a test talks to: the double (default) or a real cluster (``K8S_TEST_KUBECONFIG``).

``kube_target`` (fixture, ``fixtures.py``) yields a ``KubeTarget``. By default it is a
``FakeCluster`` (pods as local processes, namespace ``batch``), as these tests always ran. With
``K8S_TEST_KUBECONFIG`` naming a kubeconfig file it is the cluster that file points at: the
kubeconfig is parsed by the ``kubernetes`` library's own loader (``load_kube_config``, which the
provider's ``KubernetesHook`` calls for a connection's ``kube_config_path``, so server, CA, token,
client certificate or exec plugin are read as in production), in a namespace the fixture creates
with a unique name and deletes afterwards; pods run ``K8S_TEST_DRIVER_IMAGE``, which that cluster
must be able to pull. The helpers (``pods``, ``create``, ``end_pod`` ...) go through the API in both
modes, so the double runs the same helper code a real cluster does.

A test that needs the double's insides (its store, its kubelet, injected faults, compaction) is
``@pytest.mark.double_only("why")``, or takes one of ``DOUBLE_FIXTURES``; with
``K8S_TEST_KUBECONFIG`` set those are deselected and listed with their reason
(``RealClusterPlugin``). Without it everything runs. docs/dispatch.md: how to run it, RBAC needed.

This module imports only pytest and the standard library at its top, but its package's
``__init__`` pulls in the double (aiohttp, the kubelet): tests/conftest.py imports it only when
``K8S_TEST_KUBECONFIG`` is set.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

    from tests.k8s_double.cluster import FakeCluster

T = TypeVar("T")
Obj = dict[str, Any]

ENV_KUBECONFIG = "K8S_TEST_KUBECONFIG"
ENV_IMAGE = "K8S_TEST_DRIVER_IMAGE"
DOUBLE_NAMESPACE = "batch"  # the double's namespace, as these tests always used
NAMESPACE_LABEL = "aibrix.test/created-by"  # on each namespace we make, to find leftovers by hand
# A real cluster schedules, pulls and reports slower than the in-process double: the tests' waits
# are written for the double and multiplied by this on a real cluster.
REAL_PATIENCE = 6.0

# Fixtures that are the double itself: a test taking one cannot run against a real cluster.
DOUBLE_FIXTURES = {
    "fake_cluster": "runs pods on the double's kubelet (process and container modes)",
    "process_cluster": "uses the double's store or kubelet directly",
    "container_cluster": "inspects the double's container kubelet (podman flags)",
    "scaling_cluster": "the scaling double (StormService, scale subresources in its store)",
}

# The API path prefix of each namespaced resource a test makes through the target.
_PATHS = {
    "pods": "/api/v1", "secrets": "/api/v1", "serviceaccounts": "/api/v1", "resourcequotas": "/api/v1",
    "configmaps": "/api/v1", "events": "/api/v1",
}  # fmt: skip


@dataclass(frozen=True)
class RealClusterSettings:
    kubeconfig: Path
    image: str


def real_cluster_settings(environ: Mapping[str, str] = os.environ) -> RealClusterSettings | None:
    """None without ``K8S_TEST_KUBECONFIG``; else its settings, or a UsageError naming what to set."""
    path = environ.get(ENV_KUBECONFIG)
    if not path:
        return None
    if not Path(path).is_file():
        raise pytest.UsageError(f"{ENV_KUBECONFIG}={path}: no such file (a kubeconfig for the cluster the "
                                "Kubernetes tests should run against; unset it to use the double)")
    image = environ.get(ENV_IMAGE)
    if not image:
        raise pytest.UsageError(
            f"{ENV_KUBECONFIG} is set, so the Kubernetes tests run against a real cluster, and their pods "
            f"need an image that cluster can pull: set {ENV_IMAGE} to the batch-driver image pushed to a "
            "registry it reaches (e.g. registry.example.com/aibrix-batch-driver:TAG; `make images` builds "
            "it locally). docs/dispatch.md.")
    return RealClusterSettings(Path(path), image)


def api_client_from_kubeconfig(kubeconfig: Path) -> ApiClient:
    """An ApiClient from a kubeconfig file through the library's loader (the provider's
    ``KubernetesHook`` calls the same ``load_kube_config`` for ``kube_config_path``); its own
    Configuration, so the process-wide default the product code sets is left alone."""
    from kubernetes import config

    return config.new_client_from_config(config_file=str(kubeconfig))


class KubeTarget:
    """One test's Kubernetes API and namespace; see the module docstring."""

    def __init__(self, kubeconfig: Path, namespace: str, image: str, *,
                 double: FakeCluster | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.image = image  # what a test's pods run (must hold `python`)
        self.double = double  # the FakeCluster when the target is the double, else None
        self.patience = 1.0 if double is not None else REAL_PATIENCE
        self.api = api_client_from_kubeconfig(kubeconfig)

    @property
    def is_double(self) -> bool:
        return self.double is not None

    def seconds(self, on_the_double: float) -> float:
        """A wait written for the double, stretched for a real cluster."""
        return on_the_double * self.patience

    def airflow_connection(self) -> str:
        """The JSON of an Airflow ``kubernetes`` connection to this target (``AIRFLOW_CONN_<ID>``)."""
        return json.dumps({"conn_type": "kubernetes",
                           "extra": {"kube_config_path": str(self.kubeconfig), "namespace": self.namespace}})

    # raw REST through the ApiClient: the objects as the server sends them (camelCase dicts)
    def request(self, method: str, path: str, body: Obj | None = None, query: list | None = None) -> Any:
        response = self.api.call_api(path, method, query_params=query or [], body=body,
                                     header_params={"Content-Type": "application/json",
                                                    "Accept": "application/json"},
                                     auth_settings=["BearerToken"], _preload_content=False,
                                     _return_http_data_only=True)  # fmt: skip
        data = response.data
        return json.loads(data) if data else None

    def _path(self, plural: str, name: str | None = None) -> str:
        base = f"{_PATHS[plural]}/namespaces/{self.namespace}/{plural}"
        return f"{base}/{name}" if name else base

    def create(self, plural: str, obj: Obj) -> Obj:
        return self.request("POST", self._path(plural), obj)

    def get(self, plural: str, name: str) -> Obj | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.request("GET", self._path(plural, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, plural: str) -> list[Obj]:
        return self.request("GET", self._path(plural))["items"]

    def pods(self) -> list[Obj]:
        return self.list("pods")

    def pod(self, name: str) -> Obj | None:
        return self.get("pods", name)

    def running(self) -> list[str]:
        """Names of the namespace's pods in phase Running (not being deleted)."""
        return [p["metadata"]["name"] for p in self.pods() if p.get("status", {}).get("phase") == "Running"
                and not p["metadata"].get("deletionTimestamp")]

    def add_secret(self, name: str, data: dict[str, str]) -> Obj:
        return self.create("secrets", {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "type": "Opaque",
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}})

    def end_pod(self, name: str) -> None:
        """End a running pod, keeping its object (it ends Failed). The double's kubelet kills it; a
        real kubelet is told through the API by lowering ``activeDeadlineSeconds`` (one of the
        few pod fields that may change on a running pod), and fails it as DeadlineExceeded."""
        if self.double is not None and self.double.kubelet is not None:
            self.double.kubelet.kill(self.namespace, name)
            return
        from kubernetes import client

        client.CoreV1Api(self.api).patch_namespaced_pod(name, self.namespace,
                                                        {"spec": {"activeDeadlineSeconds": 1}})

    def quota_counted(self, name: str, used: Mapping[str, str] | None = None) -> bool:
        """Whether the ResourceQuota ``name`` is counted (``used``: to these values). A real server
        refuses every create while a new quota's status is empty, and frees its use only after the
        quota controller recounts; the double reports the status its admission counts by."""
        status = (self.get("resourcequotas", name) or {}).get("status") or {}
        have = status.get("used") or {}
        return bool(status.get("hard")) and all(have.get(k) == v for k, v in (used or {}).items())

    def wait_for(self, fn: Callable[[], T], timeout: float, what: str = "condition",
                 interval: float = 0.05) -> T:
        """``fn()`` once truthy; ``timeout`` is for the double, stretched by ``patience``."""
        deadline = time.monotonic() + self.seconds(timeout)
        while True:
            value = fn()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {self.seconds(timeout)}s waiting for {what}")
            time.sleep(interval if self.is_double else max(interval, 0.5))


@contextlib.contextmanager
def open_target(workdir: Path, environ: Mapping[str, str] = os.environ) -> Iterator[KubeTarget]:
    """The double by default; with ``K8S_TEST_KUBECONFIG`` a real cluster, in a fresh namespace."""
    settings = real_cluster_settings(environ)
    if settings is None:
        import sys

        from tests.k8s_double.cluster import FakeCluster
        from tests.k8s_double.fixtures import LOCAL_PYTHON_IMAGE
        from tests.k8s_double.kubelet import Image

        images = {LOCAL_PYTHON_IMAGE: Image({"python": sys.executable})}
        with FakeCluster(workdir / "k8s", images=images) as cluster:
            yield KubeTarget(cluster.kubeconfig, DOUBLE_NAMESPACE, LOCAL_PYTHON_IMAGE, double=cluster)
        return
    with real_namespace(settings.kubeconfig) as namespace:
        yield KubeTarget(settings.kubeconfig, namespace, settings.image)


@contextlib.contextmanager
def real_namespace(kubeconfig: Path) -> Iterator[str]:
    """A namespace of our own on the cluster (unique name), deleted afterwards. The delete is not
    waited for: a real namespace controller finalizes its contents asynchronously."""
    from kubernetes import client

    core = client.CoreV1Api(api_client_from_kubeconfig(kubeconfig))
    name = f"aibrix-test-{uuid.uuid4().hex[:10]}"
    core.create_namespace({"apiVersion": "v1", "kind": "Namespace",
                           "metadata": {"name": name, "labels": {NAMESPACE_LABEL: "pytest"}}})
    try:
        yield name
    finally:
        core.delete_namespace(name, propagation_policy="Background")


# --- the pytest side: deselect what needs the double, say why ---------------------------------


def double_only_reason(item: pytest.Item) -> str | None:
    """Why ``item`` needs the double (its ``double_only`` marker, or a double fixture); None if not."""
    if marker := item.get_closest_marker("double_only"):
        return str(marker.args[0]) if marker.args else "marked double_only"
    for name in getattr(item, "fixturenames", ()):
        if name in DOUBLE_FIXTURES:
            return f"fixture {name}: {DOUBLE_FIXTURES[name]}"
    return None


class RealClusterPlugin:
    """Registered by tests/conftest.py when ``K8S_TEST_KUBECONFIG`` is set (settings checked first)."""

    def __init__(self, settings: RealClusterSettings) -> None:
        self.settings = settings
        self.deselected: list[tuple[str, str]] = []

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        keep, drop = [], []
        for item in items:
            reason = double_only_reason(item)
            (drop if reason else keep).append(item)
            if reason:
                self.deselected.append((item.nodeid, reason))
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        return [f"kubernetes: real cluster from {ENV_KUBECONFIG}={self.settings.kubeconfig}, "
                f"pods run {self.settings.image}"]

    def pytest_report_collectionfinish(self, config: pytest.Config, start_path: Path,
                                       items: list[pytest.Item]) -> list[str]:
        if not self.deselected:
            return []
        lines = [f"{ENV_KUBECONFIG}: {len(self.deselected)} double-only tests deselected (they need the "
                 "Kubernetes API double's insides):"]
        return lines + [f"  {nodeid}: {reason}" for nodeid, reason in self.deselected]


def configure(config: pytest.Config) -> None:
    """From tests/conftest.py's pytest_configure when ``K8S_TEST_KUBECONFIG`` is set: check the
    settings (a UsageError ends the session, naming what to set) and register the plugin."""
    settings = real_cluster_settings()
    if settings is not None:
        config.pluginmanager.register(RealClusterPlugin(settings), "aibrix-k8s-real-cluster")
