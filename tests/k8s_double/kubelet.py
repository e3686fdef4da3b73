"""A fake kubelet: runs each pod of an ``ObjectStore`` as a real container (podman) or a local
process, and reports back.

For every pod it finds it does what a node would, writing the results into the store
the way a kubelet's status updates reach the API server: ``PodScheduled`` →
image "pull" (the image must be in ``images``, else ``ErrImagePull``) → env resolution
(``value``, ``valueFrom.secretKeyRef`` from Secrets in the store, ``fieldRef`` of
``metadata.name``/``metadata.namespace``; a missing Secret or key is
``CreateContainerConfigError``) → the first container, run one of two ways:

* **container** (``Image(container="localhost/...")``): ``podman run`` of that local image,
  ``command`` replacing its ENTRYPOINT and ``args`` its CMD as Kubernetes does, ``workingDir``,
  **only** the pod's env (passed through a private env file, never a command line),
  ``--network host`` (the pod reaches the tests' 127.0.0.1 services), ``--pull never``.
  Signals go to the container (``podman kill``), so graceful deletion, kill, evict and
  ``activeDeadlineSeconds`` reach the image's real PID 1;
* **process** (``Image({"python": sys.executable})``): ``command + args`` as a local process
  (the image maps executables to local paths) with only that env plus the image's base env;

→ phase,
container state, exit code, stdout+stderr as pod logs, and Events
(``Scheduled``, ``Pulled``, ``Started``, ``FailedScheduling``, ``Failed``, ``Killing``,
``Evicted``).

Also modelled: ``activeDeadlineSeconds`` (killed, ``reason: DeadlineExceeded``),
graceful deletion (SIGTERM, SIGKILL after the grace period, then the object goes),
``schedulable = False`` (pods stay Pending as Unschedulable), ``kill`` (the container
dies with 128+signal) and ``evict`` (``reason: Evicted``). Not modelled: restarts
(every pod behaves as ``restartPolicy: Never``), init/sidecar containers, volumes. A
container-mode pod runs with its securityContext, memory and CPU limits (security.py: the user,
a read-only root, capabilities, ``runAsNonRoot`` refused as the kubelet refuses it, an OOM kill at
the memory limit reported as ``OOMKilled``); a process-mode pod with none of them. Pods bound
(``spec.nodeName``) to another node are left alone, so a test can add pods "running elsewhere"
with any status it likes.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.k8s_double import podman, security
from tests.k8s_double.api import ApiError, Obj, ObjectStore, now_rfc3339

PODS = "/api/v1/pods"


@dataclass
class Image:
    """What an image name runs as on this machine."""

    executables: dict[str, str] = field(default_factory=dict)  # e.g. {"python": sys.executable}
    env: dict[str, str] = field(default_factory=dict)  # the image's own ENV lines (process mode)
    workdir: str | None = None
    container: str | None = None  # a local podman image: pods of this image run as containers of it


@dataclass
class PodRun:
    """One pod's life on this node (kept after the pod is gone, for assertions)."""

    namespace: str
    name: str
    uid: str
    labels: dict[str, str]
    argv: list[str] = field(default_factory=list)
    env_names: list[str] = field(default_factory=list)
    started_at: float | None = None
    finished_at: float | None = None
    exit_code: int | None = None
    reason: str | None = None  # Completed, Error, OOMKilled, Evicted, DeadlineExceeded
    proc: subprocess.Popen | None = field(default=None, repr=False)
    delete_deadline: float | None = None
    kill_reason: str | None = None
    kill_message: str | None = None
    waiting_reason: str | None = None
    events_sent: set[str] = field(default_factory=set)
    container_name: str | None = None  # container mode: the podman container running the pod
    pending_signal: int | None = None  # container mode: a signal sent before the container existed


class FakeKubelet:
    def __init__(
        self,
        store: ObjectStore,
        images: dict[str, Image],
        *,
        node_name: str = "fake-node-1",
        base_env: dict[str, str] | None = None,
        workdir: Path | None = None,
        poll_s: float = 0.05,
    ) -> None:
        self.store = store
        self.images = images
        self.node_name = node_name
        self.base_env = (
            base_env
            if base_env is not None
            else {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "LANG": "C.UTF-8",
            }
        )
        self.workdir = workdir
        self.poll_s = poll_s
        self.schedulable = True
        self.unschedulable_message = "0/1 nodes are available: 1 Insufficient cpu."
        self.runs: dict[str, PodRun] = {}  # by pod uid: a re-created name is a new pod
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="fake-kubelet", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(5)
        with self._lock:
            for run in self.runs.values():
                if run.proc and run.proc.poll() is None:
                    self._signal(run, signal.SIGKILL)
                    run.proc.wait(30)
                if run.container_name:
                    podman.remove(run.container_name)

    def run_of(self, namespace: str, name: str) -> PodRun:
        """The latest pod of that name (names can be reused after a deletion)."""
        with self._lock:
            found = [r for r in self.runs.values() if (r.namespace, r.name) == (namespace, name)]
            if not found:
                raise KeyError(f"no pod {namespace}/{name} ran on this node")
            return found[-1]

    # test controls
    def kill(self, namespace: str, name: str, sig: int = signal.SIGKILL, reason: str | None = None) -> None:
        """The container dies (e.g. a crash, or ``reason="OOMKilled"``); the pod ends Failed."""
        with self._lock:
            run = self.run_of(namespace, name)
            run.kill_reason = reason
            if run.proc and run.proc.poll() is None:
                self._signal(run, sig)

    def evict(
        self, namespace: str, name: str, message: str = "The node was low on resource: memory."
    ) -> None:
        with self._lock:
            run = self.run_of(namespace, name)
            run.kill_reason, run.kill_message = "Evicted", message
            self._event(namespace, name, "Evicted", message, "Warning")
            if run.proc and run.proc.poll() is None:
                self._signal(run, signal.SIGKILL)

    def running(self, namespace: str | None = None) -> list[PodRun]:
        with self._lock:
            return [
                r
                for r in self.runs.values()
                if r.proc and r.proc.poll() is None and namespace in (None, r.namespace)
            ]

    def all_runs(self) -> list[PodRun]:
        with self._lock:
            return list(self.runs.values())

    # the API server asks before deleting a pod: True = we finish the deletion gracefully
    def on_pod_delete(self, namespace: str, name: str, grace: int | None) -> bool:
        with self._lock:
            found = [r for r in self.runs.values() if (r.namespace, r.name) == (namespace, name)]
            run = found[-1] if found else None
            if run is None or run.proc is None or run.proc.poll() is not None:
                return False
            grace = 30 if grace is None else grace
            run.delete_deadline = time.monotonic() + grace
            self._event(namespace, name, "Killing", "Stopping container base", "Normal")
            self._signal(run, signal.SIGKILL if grace == 0 else signal.SIGTERM)
            return True

    # the node's loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception as exc:  # noqa: BLE001 - a fake node must keep running; say why it hiccuped
                print(f"fake kubelet: {type(exc).__name__}: {exc}", flush=True)
            self._stop.wait(self.poll_s)

    def _sync(self) -> None:
        for pod in self.store.list(PODS):
            if pod["spec"].get("nodeName") not in (None, self.node_name):
                continue  # bound to another node: not this kubelet's to run
            meta = pod["metadata"]
            with self._lock:
                run = self.runs.get(meta["uid"])
                if run is None:
                    run = self.runs[meta["uid"]] = PodRun(
                        meta["namespace"], meta["name"], meta["uid"], dict(meta.get("labels") or {})
                    )
                if run.proc is not None:
                    self._watch_process(pod, run)
                elif run.reason is None:
                    self._admit(pod, run)
        with self._lock:  # processes of pods that are gone from the store
            for run in self.runs.values():
                if run.proc is None or self.store.get(PODS, run.namespace, run.name) is not None:
                    continue
                if run.proc.poll() is None:
                    self._signal(run, signal.SIGKILL)
                    continue
                code = run.proc.returncode
                run.exit_code, run.finished_at = (code if code >= 0 else 128 - code), time.time()
                run.reason, run.proc = run.reason or "Deleted", None
                self.store.close_log(run.namespace, run.name)

    def _admit(self, pod: Obj, run: PodRun) -> None:
        ns, name = run.namespace, run.name
        if run.reason is not None or pod["status"].get("phase") in ("Succeeded", "Failed"):
            return
        if pod["metadata"].get("deletionTimestamp"):
            self.store.remove(PODS, ns, name)
            return
        if not self.schedulable:
            if self._scheduler_event_once(run, "FailedScheduling", self.unschedulable_message, "Warning"):
                self._set_status(
                    ns,
                    name,
                    {
                        "phase": "Pending",
                        "conditions": [
                            {
                                "type": "PodScheduled",
                                "status": "False",
                                "reason": "Unschedulable",
                                "message": self.unschedulable_message,
                                "lastTransitionTime": now_rfc3339(),
                            }
                        ],
                    },
                )
            return
        container = pod["spec"]["containers"][0]
        cname, image_name = container["name"], container.get("image", "")
        self._scheduler_event_once(run, "Scheduled", f"Successfully assigned {ns}/{name} to {self.node_name}",
                                   "Normal")
        image = self.images.get(image_name)
        if image is None:
            self._wait(
                run,
                cname,
                image_name,
                "ErrImagePull",
                f'failed to pull and unpack image "{image_name}": not found',
            )
            return
        try:
            env = self._resolve_env(ns, pod, container)
        except ApiError as exc:
            self._wait(run, cname, image_name, "CreateContainerConfigError", exc.message)
            return
        command, args = list(container.get("command") or []), list(container.get("args") or [])
        if image.container is None and not command + args:
            self._wait(
                run, cname, image_name, "CreateContainerError", "no command: a process image has no CMD"
            )
            return
        run.argv, run.env_names = command + args, sorted(env)
        self.store.reset_log(ns, name)
        if image.container is not None:
            try:
                flags = security.podman_flags(
                    pod, container, security.image_user(tuple(podman.PODMAN), image.container)
                )
            except security.ContainerConfigError as exc:
                self._wait(run, cname, image_name, "CreateContainerConfigError", str(exc))
                return
            run.container_name = f"k8s-{ns}-{name}-{run.uid[:8]}"
            proc = podman.start(
                run.container_name, image.container, command, args, env, container.get("workingDir"), flags
            )
        else:
            argv = [*command, *args]
            argv[0] = image.executables.get(argv[0], argv[0])
            proc = subprocess.Popen(
                argv,
                env={**self.base_env, **image.env, **env},
                cwd=container.get("workingDir") or image.workdir or (self.workdir and str(self.workdir)),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        run.proc, run.started_at, run.waiting_reason = proc, time.time(), None
        threading.Thread(target=self._pump_logs, args=(ns, name, proc), daemon=True).start()
        self._event(
            ns, name, "Pulled", f'Container image "{image_name}" already present on machine', "Normal"
        )
        self._event(ns, name, "Started", f"Started container {cname}", "Normal")
        started = now_rfc3339()
        image_id = f"podman://{image.container}" if image.container else f"double://{image_name}"
        self._set_status(
            ns,
            name,
            {
                "phase": "Running",
                "hostIP": "127.0.0.1",
                "podIP": "127.0.0.1",
                "startTime": started,
                "conditions": [
                    {"type": t, "status": "True", "lastTransitionTime": started}
                    for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
                ],
                "containerStatuses": [
                    {
                        "name": cname,
                        "image": image_name,
                        "imageID": image_id,
                        "ready": True,
                        "started": True,
                        "restartCount": 0,
                        "state": {"running": {"startedAt": started}},
                    }
                ],
            },
        )

    def _wait(self, run: PodRun, cname: str, image: str, reason: str, message: str) -> None:
        if run.waiting_reason == reason:
            return
        run.waiting_reason = reason
        self._event(run.namespace, run.name, "Failed", message, "Warning")
        self._set_status(
            run.namespace,
            run.name,
            {
                "phase": "Pending",
                "conditions": [
                    {"type": "PodScheduled", "status": "True", "lastTransitionTime": now_rfc3339()}
                ],
                "containerStatuses": [
                    {
                        "name": cname,
                        "image": image,
                        "imageID": "",
                        "ready": False,
                        "started": False,
                        "restartCount": 0,
                        "state": {"waiting": {"reason": reason, "message": message}},
                    }
                ],
            },
        )

    def _watch_process(self, pod: Obj, run: PodRun) -> None:
        assert run.proc is not None
        deadline = pod["spec"].get("activeDeadlineSeconds")
        code = run.proc.poll()
        if code is None:
            if (
                deadline
                and run.started_at
                and time.time() - run.started_at >= deadline
                and not run.kill_reason
            ):
                run.kill_reason = "DeadlineExceeded"
                run.kill_message = "Pod was active on the node longer than the specified deadline"
                self._event(run.namespace, run.name, "DeadlineExceeded", run.kill_message, "Warning")
                self._signal(run, signal.SIGKILL)
            if run.delete_deadline and time.monotonic() >= run.delete_deadline:
                self._signal(run, signal.SIGKILL)
            elif run.pending_signal is not None:
                self._signal(run, run.pending_signal)
            return
        if run.reason is not None:
            return
        exit_code = code if code >= 0 else 128 - code
        run.exit_code, run.finished_at = exit_code, time.time()
        time.sleep(0.05)  # let the log pump take the last lines
        self.store.close_log(run.namespace, run.name)
        # A container killed by its memory limit: conmon's word for it (podman.oom_killed).
        oom = run.kill_reason == "OOMKilled" or (
            run.container_name is not None and podman.oom_killed(run.proc)
        )
        c_reason = "OOMKilled" if oom else ("Completed" if exit_code == 0 else "Error")
        run.reason = run.kill_reason if run.kill_reason in ("Evicted", "DeadlineExceeded") else c_reason
        if pod["metadata"].get("deletionTimestamp"):
            self.store.remove(PODS, run.namespace, run.name)
            run.proc = None
            return
        cname = pod["spec"]["containers"][0]["name"]
        status: dict[str, Any] = {
            "phase": "Succeeded" if exit_code == 0 and not run.kill_reason else "Failed",
            "containerStatuses": [
                {
                    "name": cname,
                    "image": pod["spec"]["containers"][0].get("image"),
                    "imageID": "",
                    "ready": False,
                    "started": False,
                    "restartCount": 0,
                    "state": {
                        "terminated": {
                            "exitCode": exit_code,
                            "reason": c_reason,
                            "startedAt": _rfc3339(run.started_at),
                            "finishedAt": _rfc3339(run.finished_at),
                        }
                    },
                }
            ],
        }
        if run.kill_reason in ("Evicted", "DeadlineExceeded"):
            status.update(reason=run.kill_reason, message=run.kill_message)
        self._set_status(run.namespace, run.name, status)
        run.proc = None

    def _pump_logs(self, ns: str, name: str, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            self.store.append_log(ns, name, raw.decode("utf-8", "backslashreplace").rstrip("\n"))

    # helpers
    def _signal(self, run: PodRun, sig: int) -> None:
        """Signal the pod's container (its PID 1), or the process group of a process pod."""
        if run.proc is None:
            return
        if run.container_name is None:
            _signal_group(run.proc, sig)
            return
        # A container that podman run has not created yet cannot be signalled: try again on the
        # next sync, as long as its podman run is alive.
        delivered = podman.kill(run.container_name, sig)
        run.pending_signal = None if delivered or run.proc.poll() is not None else sig

    def _resolve_env(self, ns: str, pod: Obj, container: Obj) -> dict[str, str]:
        env: dict[str, str] = {}
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = str(item["value"])
                continue
            source = item.get("valueFrom") or {}
            if ref := source.get("secretKeyRef"):
                value = self._secret_value(ns, ref)
                if value is not None:
                    env[item["name"]] = value
            elif ref := source.get("fieldRef"):
                path = ref.get("fieldPath")
                env[item["name"]] = {"metadata.name": pod["metadata"]["name"], "metadata.namespace": ns}.get(
                    path, ""
                )
            else:
                env[item["name"]] = ""
        return env

    def _secret_value(self, ns: str, ref: Obj) -> str | None:
        secret = self.store.get("/api/v1/secrets", ns, ref["name"])
        optional = bool(ref.get("optional"))
        if secret is None:
            if optional:
                return None
            raise ApiError(400, "CreateContainerConfigError", f'secret "{ref["name"]}" not found')
        if ref["key"] in (secret.get("stringData") or {}):
            return secret["stringData"][ref["key"]]
        if ref["key"] in (secret.get("data") or {}):
            return base64.b64decode(secret["data"][ref["key"]]).decode()
        if optional:
            return None
        raise ApiError(
            400, "CreateContainerConfigError", f"couldn't find key {ref['key']} in Secret {ns}/{ref['name']}"
        )

    def _set_status(self, ns: str, name: str, status: Obj) -> None:
        try:
            self.store.update(PODS, ns, name, lambda o: {**o, "status": {**o.get("status", {}), **status}})
        except ApiError:
            pass  # deleted meanwhile

    def _scheduler_event_once(self, run: PodRun, reason: str, message: str, kind: str) -> bool:
        """The scheduler's ``reason`` event for the pod, the first time only; True when sent now."""
        if reason in run.events_sent:
            return False
        run.events_sent.add(reason)
        self._event(run.namespace, run.name, reason, message, kind, component="default-scheduler")
        return True

    def _event(
        self, ns: str, pod: str, reason: str, message: str, kind: str, component: str = "kubelet"
    ) -> None:
        now = now_rfc3339()
        obj = self.store.get(PODS, ns, pod) or {"metadata": {}}
        self.store.create(
            "/api/v1/events",
            ns,
            {
                "kind": "Event",
                "apiVersion": "v1",
                "metadata": {"name": f"{pod}.{uuid.uuid4().hex[:12]}"},
                "involvedObject": {
                    "kind": "Pod",
                    "namespace": ns,
                    "name": pod,
                    "apiVersion": "v1",
                    "uid": obj["metadata"].get("uid"),
                    "fieldPath": "spec.containers{base}",
                },
                "reason": reason,
                "message": message,
                "type": kind,
                "count": 1,
                "firstTimestamp": now,
                "lastTimestamp": now,
                "source": {"component": component},
            },
        )


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _rfc3339(t: float | None) -> str | None:
    if t is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
