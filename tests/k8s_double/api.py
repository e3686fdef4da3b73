"""A minimal Kubernetes API server double, spoken to over real HTTP.

It keeps objects in memory and serves the REST shapes the ``kubernetes`` and
``kubernetes_asyncio`` clients (and so the cncf-kubernetes provider) use:

* any namespaced resource: ``/api/v1/namespaces/{ns}/{plural}[/{name}[/{sub}]]`` and
  ``/apis/{group}/{version}/namespaces/{ns}/{plural}[/{name}[/{sub}]]`` —
  create (POST), get, list (``labelSelector``, ``fieldSelector``), watch
  (``?watch=true``, ``resourceVersion``, ``timeoutSeconds``), patch (JSON merge /
  strategic merge treated as a merge), replace (PUT), delete; ``status`` as a
  subresource of any object; a write carrying a stale ``metadata.resourceVersion`` is a 409;
* namespaces (``/api/v1/namespaces[/{name}]``): create, get, list, delete; a delete removes
  the namespace and everything in it at once (a real server marks it Terminating and its
  namespace controller empties it asynchronously), so a test may make and drop its own namespace
  as it does on a real cluster (``target.py``);
* ``pods/{name}/log`` (``container``, ``follow``, ``timestamps``, ``tailLines``,
  ``sinceSeconds``) from lines a kubelet appends with ``append_log``;
* pod deletion with a grace period: while a kubelet runs the pod, DELETE only sets
  ``deletionTimestamp``; the kubelet stops the process and calls ``remove``.

A ResourceQuota read carries the ``status`` its controller would write (``quota.status``).
Bearer-token auth (401 otherwise) and injected faults (``fail``: a status for the
next N matching requests; ``stall_watches``: watches that send nothing) let tests
drive the clients' error paths. Admission: a pod create over a namespace's ResourceQuota
is refused with the API server's own 403 text (``quota.py``). Authorization: with ``rbac`` set
(``rbac.py``, from the rendered Roles), a request no rule allows is refused as RBAC refuses it.
Not modelled: other admission plugins, field validation, server-side apply, json-patch.

Thread safety: the server runs on its own event loop (``FakeCluster`` starts it in
a thread); ``ObjectStore`` methods may be called from any thread.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from tests.k8s_double import quota, rbac

Obj = dict[str, Any]
Key = tuple[str, str, str]  # (resource path prefix incl. plural, namespace, name)

_KINDS = {
    "pods": "Pod",
    "secrets": "Secret",
    "events": "Event",
    "configmaps": "ConfigMap",
    "services": "Service",
    "serviceaccounts": "ServiceAccount",
    "resourcequotas": "ResourceQuota",
    "namespaces": "Namespace",
}


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_body(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (``None`` deletes a key)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# --- selectors -------------------------------------------------------------------------------

_SET_RE = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def label_selector_matches(selector: str | None, labels: dict[str, str] | None) -> bool:
    """Equality (``=``, ``==``, ``!=``), set (``in``, ``notin``) and existence (``k``, ``!k``)."""
    labels = labels or {}
    for req in _split_selector(selector or ""):
        if m := _SET_RE.match(req):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if (op == "in") != (key in labels and labels[key] in values):
                return False
        elif "!=" in req:
            key, value = (s.strip() for s in req.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in req:
            key, value = (s.strip() for s in req.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif req.startswith("!"):
            if req[1:].strip() in labels:
                return False
        elif req not in labels:
            return False
    return True


def field_selector_matches(selector: str | None, obj: Obj) -> bool:
    """Dotted-path equality and inequality (``involvedObject.name=x``, ``status.phase!=Failed``)."""
    for req in _split_selector(selector or ""):
        negate = "!=" in req
        path, value = (s.strip() for s in req.replace("==", "=").split("!=" if negate else "=", 1))
        cur: Any = obj
        for part in path.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if (str(cur) == value if cur is not None else value == "") == negate:
            return False
    return True


# --- the store -------------------------------------------------------------------------------


@dataclass
class LogLine:
    at: float
    text: str


@dataclass
class Fault:
    method: str
    path: re.Pattern[str]
    status: int
    times: int
    message: str
    hits: int = 0


class ObjectStore:
    """Objects by (resource prefix, namespace, name), a global resourceVersion and watch fan-out."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._objects: dict[Key, Obj] = {}
        self._rv = 0
        self._history: list[tuple[int, str, Key, Obj]] = []
        # As etcd compacts and the watch cache holds a window: a watch from before the oldest
        # event still held is a 410 Gone (ERROR event, reason Expired), as the API server answers.
        self.history_limit = 10_000
        self._compacted_rv = 0  # the newest resourceVersion no longer in the history
        self._watchers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, Callable[[Key, Obj], bool]]] = []
        self._logs: dict[tuple[str, str], list[LogLine]] = {}
        self._log_closed: set[tuple[str, str]] = set()
        self.requests: list[tuple[str, str]] = []  # (method, path?query): what clients asked, in order

    # objects
    def _bump(self, event: str, key: Key, obj: Obj) -> Obj:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        snapshot = copy.deepcopy(obj)
        self._history.append((self._rv, event, key, snapshot))
        if len(self._history) > self.history_limit:
            self._compacted_rv = self._history.pop(0)[0]
        for loop, queue, wants in list(self._watchers):
            if wants(key, snapshot):
                loop.call_soon_threadsafe(queue.put_nowait, (event, snapshot))
        return copy.deepcopy(obj)

    def create(self, prefix: str, namespace: str, obj: Obj) -> Obj:
        with self._lock:
            obj = copy.deepcopy(obj)
            meta = obj.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            key = (prefix, namespace, meta.get("name") or "")
            if not key[2]:
                raise ApiError(422, "Invalid", "metadata.name: Required value")
            if key in self._objects:
                raise ApiError(409, "AlreadyExists", f'{prefix.rsplit("/", 1)[-1]} "{key[2]}" already exists')
            meta.update(namespace=namespace, uid=str(uuid.uuid4()), creationTimestamp=now_rfc3339())
            meta.setdefault("labels", {})
            plural = prefix.rsplit("/", 1)[-1]
            if plural == "pods":
                try:  # the quota admission plugin, before anything is stored
                    quota.admit_pod(self.list(quota.QUOTAS, namespace), self.list(prefix, namespace),
                                    key[2], obj)  # fmt: skip
                except quota.QuotaExceeded as exc:
                    raise ApiError(403, "Forbidden", str(exc)) from None
                obj.setdefault("status", {}).setdefault("phase", "Pending")
                obj["spec"].setdefault("restartPolicy", "Always")
            self._objects[key] = obj
            return self._bump("ADDED", key, obj)

    def get(self, prefix: str, namespace: str, name: str) -> Obj | None:
        with self._lock:
            obj = self._objects.get((prefix, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def list(self, prefix: str, namespace: str | None = None) -> list[Obj]:
        with self._lock:
            return [
                copy.deepcopy(o)
                for (p, ns, _), o in self._objects.items()
                if p == prefix and (namespace is None or ns == namespace)
            ]

    def update(
        self, prefix: str, namespace: str, name: str, change: Callable[[Obj], Obj | None],
        expect_version: str | None = None,
    ) -> Obj:
        """Apply ``change`` (mutate in place or return a replacement) and publish MODIFIED.
        With ``expect_version`` (a write that carries ``metadata.resourceVersion``), a stored
        object that changed since is a 409 Conflict, as the API server's optimistic concurrency."""
        with self._lock:
            key = (prefix, namespace, name)
            obj = self._objects.get(key)
            plural = prefix.rsplit("/", 1)[-1]
            if obj is None:
                raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
            if expect_version is not None and obj["metadata"]["resourceVersion"] != expect_version:
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {plural} "{name}": the '
                               "object has been modified; please apply your changes to the latest version "
                               "and try again")  # fmt: skip
            new = change(obj)
            if new is not None:
                new["metadata"] = {**obj["metadata"], **new.get("metadata", {})}
                obj = self._objects[key] = new
            return self._bump("MODIFIED", key, obj)

    def remove(self, prefix: str, namespace: str, name: str) -> Obj | None:
        with self._lock:
            key = (prefix, namespace, name)
            obj = self._objects.pop(key, None)
            if obj is None:
                return None
            return self._bump("DELETED", key, obj)

    def remove_namespace(self, namespace: str) -> list[Key]:
        """Remove every object in ``namespace`` (DELETED events for each); returns their keys."""
        with self._lock:
            keys = [k for k in self._objects if k[1] == namespace]
            for key in keys:
                self.remove(*key)
            return keys

    @property
    def resource_version(self) -> int:
        return self._rv

    # watches
    def compact(self) -> None:
        """Drop the history up to now (etcd's compaction): older watches are 410 Gone."""
        with self._lock:
            self._compacted_rv = self._rv
            self._history.clear()

    def subscribe(
        self, loop: asyncio.AbstractEventLoop, wants: Callable[[Key, Obj], bool], since_rv: int | None
    ) -> tuple[asyncio.Queue, list[tuple[str, Obj]]]:
        """A watch's queue and its backlog; ApiError 410 for a ``since_rv`` compacted away."""
        with self._lock:
            if since_rv is not None and since_rv < self._compacted_rv:
                oldest = self._compacted_rv + 1
                raise ApiError(410, "Expired", f"too old resource version: {since_rv} ({oldest})")
            queue: asyncio.Queue = asyncio.Queue()
            if since_rv is None:  # "start at most recent": synthetic ADDED for what exists
                backlog = [("ADDED", copy.deepcopy(o)) for k, o in self._objects.items() if wants(k, o)]
            else:
                backlog = [
                    (e, copy.deepcopy(o)) for rv, e, k, o in self._history if rv > since_rv and wants(k, o)
                ]
            self._watchers.append((loop, queue, wants))
            return queue, backlog

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        with self._lock:
            self._watchers = [w for w in self._watchers if w[1] is not queue]

    # pod logs (written by a kubelet)
    def append_log(self, namespace: str, pod: str, text: str) -> None:
        with self._lock:
            self._logs.setdefault((namespace, pod), []).append(LogLine(time.time(), text))

    def close_log(self, namespace: str, pod: str) -> None:
        with self._lock:
            self._log_closed.add((namespace, pod))

    def log_lines(self, namespace: str, pod: str) -> tuple[list[LogLine], bool]:
        with self._lock:
            return list(self._logs.get((namespace, pod), [])), (namespace, pod) in self._log_closed

    def reset_log(self, namespace: str, pod: str) -> None:
        with self._lock:
            self._logs.pop((namespace, pod), None)
            self._log_closed.discard((namespace, pod))


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


# --- the HTTP server -------------------------------------------------------------------------

_CORE = re.compile(
    r"^/api/v1/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)
_GROUP = re.compile(
    r"^/apis/(?P<group>[^/]+)/(?P<version>[^/]+)/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)"
    r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)
_CLUSTER_LIST = re.compile(r"^/api/v1/(?P<plural>pods|events|secrets)$")
_NAMESPACES = re.compile(r"^/api/v1/namespaces(?:/(?P<name>[^/]+))?$")
NAMESPACES = "/api/v1/namespaces"  # stored cluster-scoped: namespace ""


@dataclass
class ApiServerDouble:
    """The HTTP face of an ``ObjectStore``; see the module docstring."""

    token: str = "k8s-double-token"
    store: ObjectStore = field(default_factory=ObjectStore)
    # Called with (namespace, name) when a pod is deleted; returns True if a kubelet will
    # finish the deletion (graceful), False to remove the object at once.
    on_pod_delete: Callable[[str, str, int | None], bool] | None = None
    # RBAC: when set, every request is authorized against these rules (rbac.py), as the
    # identity the test's token stands for; None admits everything the token may reach.
    rbac: rbac.Authorizer | None = None
    _faults: list[Fault] = field(default_factory=list)
    _stall_watches: re.Pattern[str] | None = None

    # faults
    def fail(
        self, method: str, path_regex: str, status: int, times: int = 1, message: str = "injected"
    ) -> Fault:
        """Answer the next ``times`` requests matching ``method`` (``*`` any) and ``path_regex``
        (searched in ``path?query``) with ``status``; returns the fault (``.hits`` counts uses)."""
        fault = Fault(method.upper(), re.compile(path_regex, re.IGNORECASE), status, times, message)
        self._faults.append(fault)
        return fault

    def stall_watches(self, path_regex: str | None) -> None:
        """Watches matching ``path_regex`` send headers and then nothing until their timeout."""
        self._stall_watches = re.compile(path_regex, re.IGNORECASE) if path_regex else None

    def clear_faults(self) -> None:
        self._faults.clear()
        self._stall_watches = None

    def _fault_for(self, method: str, target: str) -> Fault | None:
        for fault in self._faults:
            if fault.hits < fault.times and fault.method in ("*", method) and fault.path.search(target):
                fault.hits += 1
                return fault
        return None

    # aiohttp
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        target = request.path_qs
        self.store.requests.append((request.method, target))
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(status_body(401, "Unauthorized", "Unauthorized"), status=401)
        if self.rbac is not None:
            wanted = rbac.attributes(request.method, request.path, dict(request.query))
            if wanted is not None and not self.rbac.allows(wanted):
                return web.json_response(status_body(403, "Forbidden", self.rbac.refusal(wanted)), status=403)
        if fault := self._fault_for(request.method, target):
            return web.json_response(
                status_body(
                    fault.status,
                    {403: "Forbidden", 409: "AlreadyExists", 404: "NotFound"}.get(
                        fault.status, "InternalError"
                    ),
                    fault.message,
                ),
                status=fault.status,
            )
        try:
            return await self._route(request)
        except ApiError as exc:
            return web.json_response(status_body(exc.code, exc.reason, exc.message), status=exc.code)

    async def _route(self, request: web.Request) -> web.StreamResponse:
        path, q = request.path, request.query
        if path in ("/version", "/version/"):
            return web.json_response({"major": "1", "minor": "33", "gitVersion": "v1.33.0-double"})
        if m := _CLUSTER_LIST.match(path):
            prefix = f"/api/v1/{m['plural']}"
            return await self._list_or_watch(request, prefix, None)
        if m := _NAMESPACES.match(path):
            return await self._namespace(request, m["name"])
        m = _CORE.match(path) or _GROUP.match(path)
        if not m:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        ns, plural, name, sub = m["ns"], m["plural"], m["name"], m["sub"]
        prefix = (
            f"/apis/{m['group']}/{m['version']}/{plural}" if "group" in m.groupdict() else f"/api/v1/{plural}"
        )
        method = request.method
        if name is None:
            if method == "GET":
                return await self._list_or_watch(request, prefix, ns)
            if method == "POST":
                body = await request.json()
                body.setdefault("kind", _KINDS.get(plural, plural.capitalize().rstrip("s")))
                body.setdefault(
                    "apiVersion", "v1" if prefix.startswith("/api/") else f"{m['group']}/{m['version']}"
                )
                return web.json_response(self.store.create(prefix, ns, body), status=201)
            raise ApiError(405, "MethodNotAllowed", method)
        if sub == "log" and plural == "pods" and method == "GET":
            return await self._pod_log(request, ns, name, q)
        if method == "GET":
            obj = self.store.get(prefix, ns, name)
            if obj is None:
                raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
            return web.json_response(self._counted(prefix, obj))
        if method in ("PATCH", "PUT"):
            body = await request.json()
            ctype = request.headers.get("Content-Type", "")
            if method == "PATCH" and "json-patch" in ctype:
                raise ApiError(415, "UnsupportedMediaType", "json-patch is not supported by the double")

            def change(obj: Obj) -> Obj:
                if sub == "status":
                    patched = (
                        merge_patch(obj.get("status"), body.get("status", {}))
                        if method == "PATCH"
                        else body.get("status", {})
                    )
                    return {**obj, "status": patched}
                if method == "PUT":
                    return {**body, "status": obj.get("status", body.get("status"))}
                return merge_patch(obj, body)

            expect = (body.get("metadata") or {}).get("resourceVersion")
            return web.json_response(self.store.update(prefix, ns, name, change, expect_version=expect))
        if method == "DELETE":
            obj = self.store.get(prefix, ns, name)
            if obj is None:
                raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
            grace = None
            if request.can_read_body:
                try:
                    grace = (await request.json() or {}).get("gracePeriodSeconds")
                except json.JSONDecodeError:
                    grace = None
            if "gracePeriodSeconds" in q:
                grace = int(q["gracePeriodSeconds"])
            if plural == "pods" and self.on_pod_delete and self.on_pod_delete(ns, name, grace):

                def mark(o: Obj) -> None:
                    o["metadata"].setdefault("deletionTimestamp", now_rfc3339())
                    o["metadata"]["deletionGracePeriodSeconds"] = 30 if grace is None else grace

                return web.json_response(self.store.update(prefix, ns, name, mark))
            return web.json_response(self.store.remove(prefix, ns, name) or obj)
        raise ApiError(405, "MethodNotAllowed", method)

    def _counted(self, prefix: str, obj: Obj) -> Obj:
        if prefix != quota.QUOTAS:
            return obj
        pods = self.store.list("/api/v1/pods", obj["metadata"]["namespace"])
        return {**obj, "status": quota.status(obj, pods)}

    async def _namespace(self, request: web.Request, name: str | None) -> web.StreamResponse:
        method = request.method
        if name is None and method == "GET":
            return await self._list_or_watch(request, NAMESPACES, "")
        if name is None and method == "POST":
            body = {"kind": "Namespace", "apiVersion": "v1", **await request.json()}
            body["status"] = {"phase": "Active"}
            return web.json_response(self.store.create(NAMESPACES, "", body), status=201)
        obj = self.store.get(NAMESPACES, "", name or "")
        if obj is None:
            raise ApiError(404, "NotFound", f'namespaces "{name}" not found')
        if method == "GET":
            return web.json_response(obj)
        if method == "DELETE":
            for prefix, ns, pod in self.store.remove_namespace(name or ""):
                if prefix == "/api/v1/pods" and self.on_pod_delete:
                    self.on_pod_delete(ns, pod, 0)  # its process stops; the object is gone already
            self.store.remove(NAMESPACES, "", name or "")
            return web.json_response({**obj, "status": {"phase": "Terminating"}})
        raise ApiError(405, "MethodNotAllowed", method)

    async def _list_or_watch(self, request: web.Request, prefix: str, ns: str | None) -> web.StreamResponse:
        q = request.query
        labels, fields = q.get("labelSelector"), q.get("fieldSelector")

        def wants(key: Key, obj: Obj) -> bool:
            return (
                key[0] == prefix
                and (ns is None or key[1] == ns)
                and label_selector_matches(labels, obj.get("metadata", {}).get("labels"))
                and field_selector_matches(fields, obj)
            )

        if q.get("watch") in ("true", "1", "True"):
            return await self._watch(request, wants, q)
        items = [
            self._counted(prefix, o)
            for o in self.store.list(prefix, ns)
            if label_selector_matches(labels, o["metadata"].get("labels"))
            and field_selector_matches(fields, o)
        ]
        kind = _KINDS.get(prefix.rsplit("/", 1)[-1], "Object") + "List"
        return web.json_response(
            {
                "kind": kind,
                "apiVersion": "v1",
                "items": items,
                "metadata": {"resourceVersion": str(self.store.resource_version)},
            }
        )

    async def _watch(
        self, request: web.Request, wants: Callable[[Key, Obj], bool], q: Any
    ) -> web.StreamResponse:
        timeout = float(q.get("timeoutSeconds", 1800))
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if self._stall_watches is not None and self._stall_watches.search(request.path_qs):
            await asyncio.sleep(timeout)
            return resp
        since = q.get("resourceVersion")
        try:
            queue, backlog = self.store.subscribe(
                asyncio.get_running_loop(), wants, int(since) if since not in (None, "", "0") else None
            )
        except ApiError as exc:  # the API server answers an expired watch in the stream, not its status
            status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "message": exc.message, "reason": exc.reason, "code": exc.code}  # fmt: skip
            await resp.write(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
            return resp
        deadline = time.monotonic() + timeout
        try:
            for event, obj in backlog:
                await resp.write(json.dumps({"type": event, "object": obj}).encode() + b"\n")
            while (left := deadline - time.monotonic()) > 0:
                try:
                    event, obj = await asyncio.wait_for(queue.get(), timeout=left)
                except TimeoutError:
                    break
                await resp.write(json.dumps({"type": event, "object": obj}).encode() + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.store.unsubscribe(queue)
        return resp

    async def _pod_log(self, request: web.Request, ns: str, name: str, q: Any) -> web.StreamResponse:
        pod = self.store.get("/api/v1/pods", ns, name)
        if pod is None:
            raise ApiError(404, "NotFound", f'pods "{name}" not found')
        container = q.get("container") or pod["spec"]["containers"][0]["name"]
        statuses = {s["name"]: s for s in pod.get("status", {}).get("containerStatuses") or []}
        state = statuses.get(container, {}).get("state", {})
        if not statuses or "waiting" in state:
            reason = state.get("waiting", {}).get("reason", "ContainerCreating")
            raise ApiError(
                400, "BadRequest", f'container "{container}" in pod "{name}" is waiting to start: {reason}'
            )
        follow = q.get("follow") in ("true", "True", "1")
        stamps = q.get("timestamps") in ("true", "True", "1")
        tail = int(q["tailLines"]) if "tailLines" in q else None
        since = time.time() - float(q["sinceSeconds"]) if "sinceSeconds" in q else None
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)

        def render(line: LogLine) -> bytes:
            prefix = ""
            if stamps:
                prefix = datetime.fromtimestamp(line.at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f000Z") + " "
            return (prefix + line.text + "\n").encode()

        lines, closed = self.store.log_lines(ns, name)
        if since is not None:
            lines = [ln for ln in lines if ln.at >= since]
        if tail is not None:
            lines = lines[-tail:] if tail else []
        sent = len(self.store.log_lines(ns, name)[0])
        for line in lines:
            await resp.write(render(line))
        while follow and not closed:
            await asyncio.sleep(0.05)
            more, closed = self.store.log_lines(ns, name)
            for line in more[sent:]:
                await resp.write(render(line))
            sent = len(more)
            if self.store.get("/api/v1/pods", ns, name) is None:
                break
        return resp


def iter_pods(store: ObjectStore, namespace: str | None = None) -> Iterator[Obj]:
    yield from store.list("/api/v1/pods", namespace)
