"""``FakeCluster``: the API double on a real port, a kubeconfig for it, and a fake kubelet."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from tests.k8s_double.api import ApiServerDouble, Obj
from tests.k8s_double.kubelet import FakeKubelet, Image

T = TypeVar("T")


class FakeCluster:
    """Start with ``with FakeCluster(tmp_path, images={...}) as cluster:``.

    * ``cluster.kubeconfig``: a kubeconfig file (token auth, plain http on 127.0.0.1);
    * ``cluster.airflow_connection(namespace)``: the JSON of an Airflow ``kubernetes``
      connection using it (for ``AIRFLOW_CONN_<ID>``);
    * ``cluster.api``: the server (``fail``, ``stall_watches``, ``store.requests``);
    * ``cluster.store``: the objects; ``cluster.kubelet``: the node (``runs``, ``kill``,
      ``evict``, ``schedulable``);
    * ``cluster.add_secret(ns, name, {key: value})``, ``cluster.pods(ns)``,
      ``cluster.wait_for(fn, timeout)``.
    """

    def __init__(self, workdir: Path, images: dict[str, Image], *, kubelet: bool = True,
                 api: ApiServerDouble | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.api = api or ApiServerDouble()  # a subclass adds what a suite needs (e.g. scale)
        self.store = self.api.store
        self.kubelet = FakeKubelet(self.store, images, workdir=self.workdir) if kubelet else None
        if self.kubelet:
            self.api.on_pod_delete = self.kubelet.on_pod_delete
        self.port = 0
        self.kubeconfig = self.workdir / "kubeconfig"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeCluster:
        ready = threading.Event()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._runner = web.AppRunner(self.api.app(), handle_signals=False)
            self._loop.run_until_complete(self._runner.setup())
            site = web.SockSite(self._runner, sock)
            self._loop.run_until_complete(site.start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="k8s-api-double", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the Kubernetes API double did not start")
        self.kubeconfig.write_text(json.dumps(self.kubeconfig_dict()))
        if self.kubelet:
            self.kubelet.start()
        return self

    def stop(self) -> None:
        if self.kubelet:
            self.kubelet.stop()
        if self._loop and self._runner:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread:
            self._thread.join(10)

    def __enter__(self) -> FakeCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # configuration for clients
    def kubeconfig_dict(self, namespace: str = "default") -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "double",
            "clusters": [{"name": "double", "cluster": {"server": self.url}}],
            "users": [{"name": "double", "user": {"token": self.api.token}}],
            "contexts": [
                {"name": "double", "context": {"cluster": "double", "user": "double", "namespace": namespace}}
            ],
        }

    def airflow_connection(self, namespace: str = "default") -> str:
        return json.dumps(
            {
                "conn_type": "kubernetes",
                "extra": {"kube_config_path": str(self.kubeconfig), "namespace": namespace},
            }
        )

    # objects
    def add_secret(self, namespace: str, name: str, data: dict[str, str]) -> Obj:
        return self.store.create(
            "/api/v1/secrets",
            namespace,
            {
                "kind": "Secret",
                "apiVersion": "v1",
                "metadata": {"name": name},
                "type": "Opaque",
                "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
            },
        )

    def pods(self, namespace: str | None = None) -> list[Obj]:
        return self.store.list("/api/v1/pods", namespace)

    def events(self, namespace: str | None = None) -> list[Obj]:
        return self.store.list("/api/v1/events", namespace)

    @staticmethod
    def wait_for(fn: Callable[[], T], timeout: float, what: str = "condition", interval: float = 0.05) -> T:
        deadline = time.monotonic() + timeout
        while True:
            value = fn()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(interval)
