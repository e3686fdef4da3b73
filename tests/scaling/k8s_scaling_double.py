"""The shared Kubernetes API double (``tests/k8s_double``) plus what scaling needs of it.

``tests/k8s_double`` serves any namespaced resource, auth, injected faults and optimistic
concurrency (a stale ``metadata.resourceVersion`` is a 409); it does not model one thing the
actuator depends on, added here by subclassing:

* the ``scale`` subresource of Deployments/StatefulSets (``autoscaling/v1`` Scale:
  GET, and PATCH that writes ``spec.replicas`` of the workload);

``before_patch`` (a callable run before each PATCH) lets a test play a concurrent
writer between the actuator's read and its write.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.k8s_double.api import ApiError, ApiServerDouble, merge_patch
from tests.k8s_double.cluster import FakeCluster

_SCALE = re.compile(
    r"^/apis/apps/v1/namespaces/(?P<ns>[^/]+)/(?P<plural>deployments|statefulsets)/(?P<name>[^/]+)/scale$")
_ANY = re.compile(
    r"^/apis?/(?:(?P<group>[^/]+)/)?[^/]+/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)/(?P<name>[^/]+)$")


class ScalingApiDouble(ApiServerDouble):
    before_patch: Callable[[str], None] | None = None

    async def _route(self, request: web.Request) -> web.StreamResponse:
        if m := _SCALE.match(request.path):
            return await self._scale(request, m["ns"], m["plural"], m["name"])
        if request.method == "PATCH" and _ANY.match(request.path) and self.before_patch:
            self.before_patch(request.path)  # a concurrent writer; the base double then answers 409
        return await super()._route(request)

    async def _scale(self, request: web.Request, ns: str, plural: str, name: str) -> web.Response:
        prefix = f"/apis/apps/v1/{plural}"
        if request.method == "PATCH":
            if self.before_patch:
                self.before_patch(request.path)
            patch = await request.json()
            replicas = (patch.get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                raise ApiError(422, "Invalid", "spec.replicas: must be a non-negative integer")
            obj = self.store.update(prefix, ns, name,
                                    lambda o: merge_patch(o, {"spec": {"replicas": replicas}}))
        elif request.method == "GET":
            obj = self.store.get(prefix, ns, name)
            if obj is None:
                raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
        else:
            raise ApiError(405, "MethodNotAllowed", request.method)
        return web.json_response(scale_of(obj))


def scale_of(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj["metadata"]
    return {"apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                         "resourceVersion": meta["resourceVersion"]},
            "spec": {"replicas": obj["spec"].get("replicas", 0)},
            "status": {"replicas": (obj.get("status") or {}).get("replicas", 0),
                       "selector": "app=vllm"}}


def workload(kind: str, name: str, replicas: int, ready: int) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}}}},
            "status": {"replicas": replicas, "readyReplicas": ready}}


def storm_service(
    name: str, prefill: int, decode: int, ready: dict[str, int] | None = None
) -> dict[str, Any]:
    ready = ready or {}
    return {
        "apiVersion": "orchestration.aibrix.ai/v1alpha1", "kind": "StormService",
        "metadata": {"name": name},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}}, "template": {"spec": {"roles": [
            {"name": "prefill", "replicas": prefill, "podGroupSize": 2, "stateful": True},
            {"name": "decode", "replicas": decode, "podGroupSize": 2, "stateful": True},
        ]}}},
        "status": {"roleStatuses": [{"name": r, "replicas": n, "readyReplicas": ready.get(r, 0)}
                                    for r, n in (("prefill", prefill), ("decode", decode))]},
    }


class ScalingCluster(FakeCluster):
    """A ``FakeCluster`` without a kubelet, serving ``ScalingApiDouble``."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, images={}, kubelet=False, api=ScalingApiDouble())

    def add(self, plural_prefix: str, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
        return self.store.create(plural_prefix, namespace, json.loads(json.dumps(obj)))

    def get(self, plural_prefix: str, namespace: str, name: str) -> dict[str, Any]:
        obj = self.store.get(plural_prefix, namespace, name)
        assert obj is not None
        return obj

    def set_ready(self, plural_prefix: str, namespace: str, name: str, ready: int,
                  role: str | None = None) -> None:
        def change(obj: dict[str, Any]) -> dict[str, Any]:
            if role is None:
                return merge_patch(obj, {"status": {"readyReplicas": ready}})
            statuses = [dict(s, readyReplicas=ready) if s["name"] == role else s
                        for s in obj["status"]["roleStatuses"]]
            return {**obj, "status": {**obj["status"], "roleStatuses": statuses}}

        self.store.update(plural_prefix, namespace, name, change)


DEPLOYMENTS = "/apis/apps/v1/deployments"
STATEFULSETS = "/apis/apps/v1/statefulsets"
STORMSERVICES = "/apis/orchestration.aibrix.ai/v1alpha1/stormservices"


@pytest.fixture
def scaling_cluster(tmp_path: Path) -> Iterator[ScalingCluster]:
    with ScalingCluster(tmp_path / "k8s") as cluster:
        yield cluster
