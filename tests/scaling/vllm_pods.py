"""Role pods for the scaling tests: pod objects in the API double whose ``/metrics`` are
served by small aiohttp servers on this machine.

The served text is a real vLLM CPU server's ``/metrics`` output (``data/vllm_metrics.txt``,
captured once from vLLM 0.32 serving the tiny test model: 600+ lines of counters,
histograms and the ``_by_reason`` gauges a sloppy parser would confuse), with the three
load gauges the autoscaler reads set to what the test wants.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.k8s_double.api import ObjectStore

REAL_METRICS = (Path(__file__).parent / "data" / "vllm_metrics.txt").read_text()
GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
          "kv_usage": "vllm:kv_cache_usage_perc"}


def vllm_metrics(running: float = 0, waiting: float = 0, kv_usage: float = 0) -> str:
    """The captured vLLM text with the load gauges set (exactly one sample each in it)."""
    text = REAL_METRICS
    for key, value in {"running": running, "waiting": waiting, "kv_usage": kv_usage}.items():
        text, n = re.subn(rf"^({re.escape(GAUGES[key])}\{{[^}}]*\}}) \S+$", rf"\g<1> {float(value)}", text,
                          flags=re.M)
        assert n == 1, f"{GAUGES[key]}: {n} samples in the fixture"
    return text


class MetricsServers:
    """One aiohttp server per fake pod on 127.0.0.1, in a background loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners: dict[int, web.AppRunner] = {}
        self.scrapes: dict[int, int] = {}

    def serve(self, text: str) -> int:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        self.scrapes[port] = 0

        async def metrics(_: web.Request) -> web.Response:
            self.scrapes[port] += 1
            return web.Response(text=text, content_type="text/plain")

        async def start() -> web.AppRunner:
            app = web.Application()
            app.router.add_get("/metrics", metrics)
            runner = web.AppRunner(app, handle_signals=False)
            await runner.setup()
            await web.SockSite(runner, sock).start()
            return runner

        self.runners[port] = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        return port

    def stop(self, port: int) -> None:
        runner = self.runners.pop(port)
        asyncio.run_coroutine_threadsafe(runner.cleanup(), self.loop).result(10)

    def close(self) -> None:
        for port in list(self.runners):
            self.stop(port)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def role_pod(name: str, role: str, port: int, ready: bool = True, ip: str = "127.0.0.1",
             node: str = "gpu-node-1") -> dict[str, Any]:
    """A running vLLM pod of ``role`` as the overlays label it, bound to another node (the
    fake kubelet runs only its own node's pods)."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "vllm",
                                              "app.kubernetes.io/component": role}},
        "spec": {"nodeName": node, "containers": [
            {"name": "vllm", "image": "aibrix-batch/vllm:0.1.0",
             "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": ip, "conditions": [
            {"type": "Ready", "status": "True" if ready else "False"}]},
    }


def add_pod(store: ObjectStore, namespace: str, pod: dict[str, Any]) -> None:
    store.create("/api/v1/pods", namespace, pod)
