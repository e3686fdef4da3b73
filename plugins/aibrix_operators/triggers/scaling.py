"""Scaling triggers: ``RolesReadyTrigger`` waits until every role has its ready replicas;
``AutoscaleTickTrigger`` waits out the autoscaler's interval and scrapes vLLM's load."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from aibrix_operators.scaling.kube import ScaleTarget, ScalingError, ready_replicas_async
from aibrix_operators.scaling.load import MetricsSource, RoleLoad, scrape_roles


class RolesReadyTrigger(BaseTrigger):
    """Polls each role's ready replicas (``kubernetes_asyncio``) until ``want[role]`` are ready.

    Fires one event: ``{"status": "ready", "ready": {role: n}}``, or
    ``{"status": "error", "message": ...}`` on a permanent API error (403, 404, retries
    spent) or when ``timeout_s`` passes with roles still short.
    """

    def __init__(self, targets: list[dict[str, Any]], want: dict[str, int], kubernetes_conn_id: str,
                 poll_interval_s: float = 10.0, timeout_s: float = 1800.0,
                 started_at: float | None = None) -> None:
        super().__init__()
        self.targets = targets
        self.want = want
        self.kubernetes_conn_id = kubernetes_conn_id
        self.poll_interval_s = poll_interval_s
        self.timeout_s = timeout_s
        self.started_at = started_at if started_at is not None else time.time()

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "targets": self.targets, "want": self.want, "kubernetes_conn_id": self.kubernetes_conn_id,
            "poll_interval_s": self.poll_interval_s, "timeout_s": self.timeout_s,
            "started_at": self.started_at})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook

        targets = [ScaleTarget(**t) for t in self.targets]
        hook = AsyncKubernetesHook(conn_id=self.kubernetes_conn_id)
        ready: dict[str, int] = {}
        try:
            async with hook.get_conn() as api:
                while True:
                    for target in targets:
                        ready[target.role] = (await ready_replicas_async(api, target)).ready
                    if all(ready[role] >= n for role, n in self.want.items()):
                        yield TriggerEvent({"status": "ready", "ready": ready})
                        return
                    if time.time() - self.started_at > self.timeout_s:
                        yield TriggerEvent({"status": "error", "ready": ready, "message": (
                            f"roles not ready after {self.timeout_s:g}s: ready {ready}, wanted {self.want}")})
                        return
                    await asyncio.sleep(self.poll_interval_s)
        except ScalingError as exc:
            yield TriggerEvent({"status": "error", "ready": ready, "message": str(exc)})


class AutoscaleTickTrigger(BaseTrigger):
    """The autoscaler's wait between decisions, ending with a scrape of vLLM's load.

    Sleeps until ``moment`` (epoch seconds) in the triggerer, then lists each role's
    Ready pods through the Kubernetes API and reads their ``/metrics``
    (``aibrix_operators.scaling.load``), and fires ``{"status": "tick", "at": ...,
    "load": {role: RoleLoad.as_dict()}}``. Scrape and API failures are in the load
    (``error``, ``unreachable``), never an exception: the decision is made without them.
    The scrape is here, not in the worker, so a slow or hung pod costs no worker slot.
    """

    def __init__(self, moment: float, sources: list[dict[str, Any]], kubernetes_conn_id: str,
                 scrape_timeout_s: float = 5.0) -> None:
        super().__init__()
        self.moment = moment
        self.sources = sources
        self.kubernetes_conn_id = kubernetes_conn_id
        self.scrape_timeout_s = scrape_timeout_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "moment": self.moment, "sources": self.sources,
            "kubernetes_conn_id": self.kubernetes_conn_id, "scrape_timeout_s": self.scrape_timeout_s})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        delay = self.moment - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        load = await scrape_load(self.sources, self.kubernetes_conn_id, self.scrape_timeout_s)
        yield TriggerEvent({"status": "tick", "at": time.time(), "load": load})


async def scrape_load(sources: list[dict[str, Any]], kubernetes_conn_id: str,
                      timeout_s: float = 5.0) -> dict[str, dict[str, Any]]:
    """``{role: RoleLoad.as_dict()}`` through the Airflow ``kubernetes`` connection; never raises."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook

    roles = [MetricsSource(**s) for s in sources]
    try:
        async with AsyncKubernetesHook(conn_id=kubernetes_conn_id).get_conn() as api:
            loads = await scrape_roles(api, roles, timeout_s)
        return {role: v.as_dict() for role, v in loads.items()}
    except Exception as exc:  # noqa: BLE001 - no cluster config etc.: decide without load
        why = f"{type(exc).__name__}: {exc}"
        return {s.role: RoleLoad(error=why).as_dict() for s in roles}
