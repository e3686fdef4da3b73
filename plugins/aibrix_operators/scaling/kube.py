"""Read and set a serving role's replicas through the Kubernetes API (the hook-like layer).

Three shapes of role, each named by a ``ScaleTarget``:

* a workload per role (``Deployment`` / ``StatefulSet``): replicas through the ``scale``
  subresource (RBAC: ``patch`` on ``deployments/scale``), ready replicas from the
  workload's status (``get`` on the workload);
* ``StatefulSetGroups`` (the plain overlay): the role is a set of tensor-parallel
  groups, one StatefulSet ``<name>-g<N>`` and one PodGroup of the same name per group.
  A group is on (``group_size`` replicas: all its ranks) or off (0), never in between;
  the role scales by switching whole groups on (lowest index first) or off (highest
  first) through each StatefulSet's ``scale`` subresource, so the actuator needs no right
  to create workloads: the overlay declares the spare groups at 0. Before a group is
  switched on its PodGroup's ``minMember`` must equal ``group_size`` (a gang of another
  size would place part of a group, or never place it). Ready replicas count whole
  ready groups only: a group missing a rank serves nothing;
* a ``StormService`` role (the AIBrix overlay): ``spec.template.spec.roles[i].replicas``.
  A JSON merge patch replaces a list whole, so the actuator reads the object, changes
  its role's entry, and patches the whole ``roles`` list *with the resourceVersion it
  read*: if anyone changed the object meanwhile the API answers 409 and the read-modify-
  write is redone, so another role's replicas (or a concurrent edit) are never lost.
  Ready replicas come from ``status.roleStatuses[name].readyReplicas``.

Errors: 403 (RBAC) and 404 are raised at once as ``ScalingError`` with what to grant or
fix; 409 is retried by re-reading; 429/5xx are retried with backoff and then raised.
``RoleScaler`` uses the sync ``kubernetes`` client (the sensor); ``ready_replicas_async``
uses ``kubernetes_asyncio`` (the trigger). Neither imports Airflow.
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

STORM_GROUP = "orchestration.aibrix.ai"
STORM_VERSION = "v1alpha1"
STORM_PLURAL = "stormservices"
PODGROUP_GROUP, PODGROUP_VERSION, PODGROUP_PLURAL = "scheduling.x-k8s.io", "v1alpha1", "podgroups"
MERGE_PATCH = "application/merge-patch+json"
RETRYABLE = frozenset({429, 500, 502, 503, 504})

Kind = Literal["Deployment", "StatefulSet", "StormService", "StatefulSetGroups"]
KINDS = ("Deployment", "StatefulSet", "StormService", "StatefulSetGroups")


@dataclass(frozen=True)
class ScaleTarget:
    """Where one role's replicas live."""

    role: str
    kind: Kind
    name: str
    namespace: str
    group_size: int = 1  # the role's podGroupSize (pods per gang)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"role {self.role}: kind must be one of {', '.join(KINDS)}")
        if self.group_size < 1:
            raise ValueError(f"role {self.role}: group_size must be >= 1")

    @classmethod
    def from_dict(cls, role: str, data: Mapping[str, Any], namespace: str,
                  group_size: int = 1) -> ScaleTarget:
        return cls(role=role, kind=data["kind"], name=data["name"],
                   namespace=data.get("namespace") or namespace, group_size=group_size)

    def describe(self) -> str:
        if self.kind == "StatefulSetGroups":
            return f"statefulsets {self.name}-g<N> (role {self.role})"
        where = f"{self.kind.lower()}/{self.name}"
        return f"{where} role {self.role}" if self.kind == "StormService" else where


@dataclass(frozen=True)
class RoleReplicas:
    spec: int
    ready: int


class ScalingError(RuntimeError):
    """An API answer that retrying will not change (or retries ran out); says what to fix."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def _status_of(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def _explain(target: ScaleTarget, verb: str, exc: BaseException) -> ScalingError:
    status = _status_of(exc)
    if status == 403:
        kind = "statefulset" if target.kind == "StatefulSetGroups" else target.kind.lower()
        resource = (f"{STORM_PLURAL}.{STORM_GROUP}" if target.kind == "StormService"
                    else f"{kind}s" + ("/scale" if verb == "patch" else ""))
        return ScalingError(
            f"forbidden: the scaling identity may not {verb} {resource} {target.name!r} in namespace "
            f"{target.namespace!r}; grant it in the namespace's Role (see k8s/ RBAC)", status)
    if status == 404:
        return ScalingError(f"{target.describe()} not found in namespace {target.namespace!r}", status)
    reason = getattr(exc, "reason", None) or type(exc).__name__
    return ScalingError(f"{verb} {target.describe()} failed: HTTP {status} {reason}", status)


def _role_entry(obj: Mapping[str, Any], target: ScaleTarget) -> tuple[list[dict[str, Any]], int]:
    roles = (((obj.get("spec") or {}).get("template") or {}).get("spec") or {}).get("roles") or []
    for i, role in enumerate(roles):
        if role.get("name") == target.role:
            return roles, i
    raise ScalingError(f"stormservice/{target.name} has no role {target.role!r} "
                       f"(roles: {[r.get('name') for r in roles]})", 404)


def storm_role_replicas(obj: Mapping[str, Any], target: ScaleTarget) -> RoleReplicas:
    roles, i = _role_entry(obj, target)
    ready = 0
    for status in (obj.get("status") or {}).get("roleStatuses") or []:
        if status.get("name") == target.role:
            ready = int(status.get("readyReplicas") or 0)
    return RoleReplicas(int(roles[i].get("replicas") or 0), ready)


def storm_role_patch(obj: Mapping[str, Any], target: ScaleTarget, replicas: int) -> dict[str, Any]:
    """The merge patch that sets one role's replicas, guarded by the resourceVersion read."""
    roles, i = _role_entry(obj, target)
    roles = copy.deepcopy(roles)
    roles[i]["replicas"] = replicas
    return {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]},
            "spec": {"template": {"spec": {"roles": roles}}}}


def role_groups(items: list[dict[str, Any]], target: ScaleTarget) -> list[tuple[int, dict[str, Any]]]:
    """The role's group StatefulSets (``<name>-g<N>``, as dicts), by index; each must be
    off (0) or whole (``group_size``): anything else is a hand edit to fix first."""
    pattern = re.compile(rf"^{re.escape(target.name)}-g(\d+)$")
    groups = sorted((int(m[1]), o) for o in items if (m := pattern.match(o["metadata"]["name"])))
    if not groups:
        raise ScalingError(f"no StatefulSets {target.name}-g<N> in namespace {target.namespace!r} "
                           f"(role {target.role})", 404)
    for _, sts in groups:
        n = int((sts.get("spec") or {}).get("replicas") or 0)
        if n not in (0, target.group_size):
            raise ScalingError(
                f"statefulset/{sts['metadata']['name']} has {n} replicas: a {target.role} group is 0 or "
                f"{target.group_size} pods (its ranks); set it back to one of those", 422)
    return groups


def groups_replicas(groups: list[tuple[int, dict[str, Any]]]) -> RoleReplicas:
    spec = ready = 0
    for _, sts in groups:
        n = int((sts.get("spec") or {}).get("replicas") or 0)
        spec += n
        if n and int((sts.get("status") or {}).get("readyReplicas") or 0) >= n:
            ready += n
    return RoleReplicas(spec, ready)


def group_switches(groups: list[tuple[int, dict[str, Any]]], target: ScaleTarget,
                   replicas: int) -> tuple[list[str], list[str]]:
    """(groups to switch on, groups to switch off) to reach ``replicas``."""
    if replicas % target.group_size:
        raise ScalingError(f"{target.describe()}: {replicas} replicas is not whole groups of "
                           f"{target.group_size}", 422)
    want = replicas // target.group_size
    if want > len(groups):
        names = [o["metadata"]["name"] for _, o in groups]
        raise ScalingError(
            f"{target.describe()}: {replicas} replicas need {want} groups, the namespace declares "
            f"{len(groups)} ({', '.join(names)}); declare more groups (k8s/overlays/plain) or "
            "lower max_replicas", 422)
    on = [o["metadata"]["name"] for _, o in groups if (o.get("spec") or {}).get("replicas")]
    off = [o["metadata"]["name"] for _, o in groups if not (o.get("spec") or {}).get("replicas")]
    if want >= len(on):
        return off[: want - len(on)], []
    return [], on[want:]


class RoleScaler:
    """Sync actuator over a ``kubernetes.client.ApiClient`` (e.g. ``KubernetesHook().api_client``)."""

    def __init__(self, api_client: Any, attempts: int = 5, backoff_s: float = 0.5,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        from kubernetes import client

        self.apps = client.AppsV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.sleep = sleep

    def _call(self, target: ScaleTarget, verb: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn``, retrying 429/5xx with backoff; 409 is the caller's to handle."""
        from kubernetes.client.exceptions import ApiException

        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except ApiException as exc:
                if exc.status == 409 or exc.status not in RETRYABLE or attempt == self.attempts:
                    if exc.status == 409:
                        raise
                    raise _explain(target, verb, exc) from exc
                self.sleep(self.backoff_s * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    def _groups(self, target: ScaleTarget) -> list[tuple[int, dict[str, Any]]]:
        listed = self._call(target, "list", lambda: self.apps.list_namespaced_stateful_set(target.namespace))
        return role_groups(self.apps.api_client.sanitize_for_serialization(listed)["items"], target)

    def _check_gang(self, target: ScaleTarget, group: str) -> None:
        """The group's PodGroup gangs exactly ``group_size`` pods (else switching it on would
        place part of a group, or never place it)."""
        try:
            pg = self._call(target, "get", lambda: self.custom.get_namespaced_custom_object(
                PODGROUP_GROUP, PODGROUP_VERSION, target.namespace, PODGROUP_PLURAL, group))
        except ScalingError as exc:
            if exc.status == 404:
                raise ScalingError(f"statefulset/{group} has no PodGroup {group!r}: its ranks would not be "
                                   "gang-scheduled; apply the overlay's PodGroups", 404) from exc
            raise
        min_member = int((pg.get("spec") or {}).get("minMember") or 0)
        if min_member != target.group_size:
            raise ScalingError(f"podgroup/{group} minMember {min_member} != the {target.role} group size "
                               f"{target.group_size} (gang_size in [aibrix_scaling] roles)", 422)

    def replicas(self, target: ScaleTarget) -> RoleReplicas:
        ns, name = target.namespace, target.name
        if target.kind == "StatefulSetGroups":
            return groups_replicas(self._groups(target))
        if target.kind == "StormService":
            obj = self._call(target, "get", lambda: self.custom.get_namespaced_custom_object(
                STORM_GROUP, STORM_VERSION, ns, STORM_PLURAL, name))
            return storm_role_replicas(obj, target)
        read = (self.apps.read_namespaced_deployment if target.kind == "Deployment"
                else self.apps.read_namespaced_stateful_set)
        workload = self._call(target, "get", lambda: read(name, ns))
        return RoleReplicas(int(workload.spec.replicas or 0), int(workload.status.ready_replicas or 0))

    def scale(self, target: ScaleTarget, replicas: int) -> int:
        """Set the role's replicas; returns the replicas it had before."""
        from kubernetes.client.exceptions import ApiException

        ns, name = target.namespace, target.name
        if target.kind == "StatefulSetGroups":
            groups = self._groups(target)
            switch_on, switch_off = group_switches(groups, target, replicas)
            for group in switch_on:
                self._check_gang(target, group)
            patch_scale = self.apps.patch_namespaced_stateful_set_scale
            for group, n in [(g, target.group_size) for g in switch_on] + [(g, 0) for g in switch_off]:
                self._call(target, "patch", lambda group=group, n=n: patch_scale(
                    group, ns, {"spec": {"replicas": n}}, _content_type=MERGE_PATCH))
            return groups_replicas(groups).spec
        if target.kind != "StormService":
            if target.kind == "Deployment":
                read = self.apps.read_namespaced_deployment_scale
                patch = self.apps.patch_namespaced_deployment_scale
            else:
                read = self.apps.read_namespaced_stateful_set_scale
                patch = self.apps.patch_namespaced_stateful_set_scale
            before = self._call(target, "get", lambda: read(name, ns)).spec.replicas or 0
            if before != replicas:
                self._call(target, "patch", lambda: patch(
                    name, ns, {"spec": {"replicas": replicas}}, _content_type=MERGE_PATCH))
            return int(before)
        for _ in range(self.attempts):
            obj = self._call(target, "get", lambda: self.custom.get_namespaced_custom_object(
                STORM_GROUP, STORM_VERSION, ns, STORM_PLURAL, name))
            before = storm_role_replicas(obj, target).spec
            if before == replicas:
                return before
            body = storm_role_patch(obj, target, replicas)
            try:
                self._call(target, "patch", lambda body=body: self.custom.patch_namespaced_custom_object(
                    STORM_GROUP, STORM_VERSION, ns, STORM_PLURAL, name, body, _content_type=MERGE_PATCH))
                return before
            except ApiException as exc:  # 409: changed since read; read again
                if exc.status != 409:
                    raise _explain(target, "patch", exc) from exc
        raise ScalingError(f"patch {target.describe()}: still conflicting (409) after {self.attempts} "
                           "read-modify-write attempts", 409)


async def ready_replicas_async(api_client: Any, target: ScaleTarget, attempts: int = 5,
                               backoff_s: float = 0.5,
                               sleep: Callable[[float], Awaitable[None]] | None = None) -> RoleReplicas:
    """``RoleScaler.replicas`` over a ``kubernetes_asyncio`` ApiClient (for triggers)."""
    import asyncio

    from kubernetes_asyncio import client
    from kubernetes_asyncio.client.exceptions import ApiException

    sleep = sleep or asyncio.sleep
    ns, name = target.namespace, target.name
    for attempt in range(1, attempts + 1):
        try:
            if target.kind == "StatefulSetGroups":
                listed = await client.AppsV1Api(api_client).list_namespaced_stateful_set(ns)
                items = api_client.sanitize_for_serialization(listed)["items"]
                return groups_replicas(role_groups(items, target))
            if target.kind == "StormService":
                obj = await client.CustomObjectsApi(api_client).get_namespaced_custom_object(
                    STORM_GROUP, STORM_VERSION, ns, STORM_PLURAL, name)
                return storm_role_replicas(obj, target)
            apps = client.AppsV1Api(api_client)
            read = (apps.read_namespaced_deployment if target.kind == "Deployment"
                    else apps.read_namespaced_stateful_set)
            workload = await read(name, ns)
            return RoleReplicas(int(workload.spec.replicas or 0), int(workload.status.ready_replicas or 0))
        except ApiException as exc:
            if exc.status not in RETRYABLE or attempt == attempts:
                raise _explain(target, "get", exc) from exc
            await sleep(backoff_s * 2 ** (attempt - 1))
    raise AssertionError("unreachable")
