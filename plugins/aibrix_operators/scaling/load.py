"""vLLM's load gauges of a serving role, scraped from its pods' ``/metrics``.

The role's pods are listed through the Kubernetes API (``kubernetes_asyncio``, label
selector of the role, same namespace) and each Ready pod's ``http://<podIP>:<port>/metrics``
is read directly: the triggerer runs in the cluster (or can reach the pod network),
and a Service would hide which pod answered. Per role the policy gets:

* ``running`` / ``waiting``: ``vllm:num_requests_running`` / ``_waiting`` summed over the
  pods (a role's queue is the sum of its pods' queues);
* ``kv_usage``: ``vllm:kv_cache_usage_perc`` averaged over the pods (one full pod among
  idle ones is a routing problem, not a capacity one).

A pod that does not answer (starting, restarting, overloaded) is counted in
``unreachable`` and left out; an API error listing pods leaves the role's load empty
with the ``error`` said. Neither fails the autoscaler: without load the policy plans
from the deadline and the measured throughput alone.

No Airflow import: the trigger (``triggers/scaling.py``) calls ``scrape_roles``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from aibrix_operators.router.load import parse_load

DEFAULT_PORT = "http"  # the vllm container's port name in both overlays


@dataclass(frozen=True)
class MetricsSource:
    """Where one role's pods are: a label selector in a namespace, and their metrics port."""

    role: str
    namespace: str
    selector: str  # e.g. app.kubernetes.io/name=vllm,app.kubernetes.io/component=decode
    port: str | int = DEFAULT_PORT  # container port name, or number
    path: str = "/metrics"
    # Tensor-parallel groups: only rank 0 (the pod named <group>-0) serves HTTP; the
    # headless ranks have no /metrics and are not "unreachable".
    rank0_only: bool = False

    @staticmethod
    def default_selector(role: str) -> str:
        """The labels both overlays give a role's vLLM pods (k8s/overlays)."""
        return f"app.kubernetes.io/name=vllm,app.kubernetes.io/component={role}"


@dataclass(frozen=True)
class RoleLoad:
    """One role's load right now (what ``RoleObservation`` takes), and how it was seen."""

    pods: int = 0  # pods whose /metrics answered
    unreachable: int = 0  # Ready pods that did not answer
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    error: str | None = None  # listing the pods failed

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> RoleLoad:
        return cls(**dict(data or {}))


def aggregate(texts: Sequence[str], unreachable: int = 0) -> RoleLoad:
    """A role's load from its pods' ``/metrics`` texts."""
    loads = [parse_load(t) for t in texts]
    if not loads:
        return RoleLoad(unreachable=unreachable)
    return RoleLoad(
        pods=len(loads), unreachable=unreachable,
        running=sum(x.running for x in loads), waiting=sum(x.waiting for x in loads),
        kv_usage=sum(x.kv_usage for x in loads) / len(loads),
    )


def _ready(pod: Any) -> bool:
    if pod.metadata.deletion_timestamp or not pod.status or not pod.status.pod_ip:
        return False
    if pod.status.phase != "Running":
        return False
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def pod_metrics_url(pod: Any, source: MetricsSource) -> str | None:
    """``http://<podIP>:<port><path>``; None when the pod has no such named port."""
    port: int | None = source.port if isinstance(source.port, int) else None
    if port is None:
        for container in pod.spec.containers or []:
            for p in container.ports or []:
                if p.name == source.port:
                    port = p.container_port
    if port is None:
        return None
    ip = pod.status.pod_ip
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}{source.path}"


async def scrape_role(api_client: Any, session: Any, source: MetricsSource,
                      timeout_s: float = 5.0) -> RoleLoad:
    """List the role's Ready pods and read their ``/metrics`` concurrently."""
    import aiohttp
    from kubernetes_asyncio import client
    from kubernetes_asyncio.client.exceptions import ApiException

    try:
        pods = await client.CoreV1Api(api_client).list_namespaced_pod(
            source.namespace, label_selector=source.selector)
    except ApiException as exc:
        why = ("forbidden: grant list on pods in the scaling Role" if exc.status == 403
               else f"HTTP {exc.status} {exc.reason}")
        return RoleLoad(error=f"list pods {source.selector!r} in {source.namespace!r}: {why}")
    urls = [pod_metrics_url(p, source) for p in pods.items if _ready(p)
            and (not source.rank0_only or p.metadata.name.rsplit("-", 1)[-1] == "0")]

    async def fetch(url: str | None) -> str | None:
        if url is None:
            return None
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return await r.text() if r.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None

    texts = await asyncio.gather(*(fetch(u) for u in urls))
    answered = [t for t in texts if t is not None]
    return aggregate(answered, unreachable=len(texts) - len(answered))


async def scrape_roles(api_client: Any, sources: Sequence[MetricsSource],
                       timeout_s: float = 5.0) -> dict[str, RoleLoad]:
    """Every role's load, the roles scraped concurrently."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        loads = await asyncio.gather(*(scrape_role(api_client, session, s, timeout_s) for s in sources))
    return {s.role: load for s, load in zip(sources, loads, strict=True)}
