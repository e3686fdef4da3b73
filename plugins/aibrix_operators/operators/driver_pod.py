"""``DriverPodRunner``: one shard's driver pod, through the cncf-kubernetes provider's public API.

Used by ``DispatchShardOperator`` in ``execution_mode=kubernetes``. No ``KubernetesPodOperator``
(neither a subclass nor one built inside the task): its deferrable path is reachable only through
semi-private methods (``execute_async``, ``trigger_reentry`` of an operator that is not the
task, the private ``_write_logs``), which a provider release may change without notice. This
class uses only what the provider publishes, pinned by ``tests/unit/test_provider_surface.py``
against the pinned provider (requirements.txt):

* ``KubernetesHook(conn_id=...)``: ``core_v1_client`` and ``get_pod_logs``;
* ``PodManager(kube_client=...)``: ``create_pod``, ``read_pod``, ``await_pod_completion``,
  ``read_pod_events``, ``delete_pod`` (each retried by the provider on 409/429/5xx), and the
  module's ``detect_pod_terminate_early_issues`` (an image that will never be pulled);
* ``KubernetesPodTrigger``, the provider's trigger, which polls the pod in the triggerer;
* ``kubernetes_helper_functions.generic_api_retry`` (the provider's API retry, for the one list
  call) and ``pod_generator.make_safe_label_value`` (Airflow's label values).

What it does (docs/dispatch.md, "How the task follows the pod"):

* the pod comes from ``driver_pods.spec.DriverPod`` (pure data, unit-tested), plus the provider's
  task-instance labels (``dag_id``, ``task_id``, ``run_id``, ``map_index``, ``try_number``);
* ``start`` reattaches to this task's pod if it still runs (the identity kept in
  ``task_state_store``, then a search by this try's labels, as the provider's operator did) or
  creates one, then defers on ``KubernetesPodTrigger``;
* ``finish`` (after the trigger) reads the pod, re-defers when the trigger gave up on a pod that
  still runs, waits for its end, keeps its log while writing it to the task log (the driver's
  last JSON line is the shard's outcome: the XCom, as in local mode; no XCom sidecar, which would
  need ``pods/exec`` rights and a second container), deletes it, and lets
  ``driver_pods.outcome.judge_pod`` say what its end means.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import string
import time
from functools import cached_property
from typing import Any

import yaml
from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
from airflow.providers.cncf.kubernetes.kubernetes_helper_functions import (
    KubernetesApiException,
    generic_api_retry,
)
from airflow.providers.cncf.kubernetes.pod_generator import make_safe_label_value
from airflow.providers.cncf.kubernetes.triggers.pod import KubernetesPodTrigger
from airflow.providers.cncf.kubernetes.utils.pod_manager import PodManager
from airflow.sdk import BaseHook, Context
from airflow.sdk.exceptions import AirflowNotFoundException, TaskDeferred
from kubernetes.client import models as k8s
from kubernetes.client.rest import ApiException
from urllib3.exceptions import HTTPError

from aibrix_operators.driver_pods.outcome import PodVerdict, container_status, judge_pod
from aibrix_operators.driver_pods.spec import CONTAINER_NAME, DriverPod, DriverPodSettings
from aibrix_operators.operators.driver_pod_states import (
    api_failure,
    finished_status,
    reason_of,
    state_line,
    still_running,
    unreachable,
)

RESUME_METHOD = "trigger_reentry"  # DispatchShardOperator's resume method (the provider's name, kept)
# Where the pod's identity is kept across tries: the key the provider's operator used, so a task
# whose pod an older version of this package created still finds it.
POD_IDENTITY_KEY = "pod_identifier"
CHECKED_LABEL = "already_checked"  # the provider's mark on a pod a finished try is done with
MAX_REDEFERS = 3  # re-deferrals when the trigger errs on a pod that still runs (as the provider)
REDEFERS_KEY = "aibrix_redefer_count"  # in the trigger's trigger_kwargs, so back in its event
TRIGGER_STATUSES = ("success", "failed", "timeout", "error")  # what KubernetesPodTrigger emits
_API_ERRORS = (HTTPError, KubernetesApiException, OSError)  # the API unreachable, after retries
_SUFFIX = string.ascii_lowercase + string.digits


class DriverPodRunner:
    def __init__(self, *, pod: DriverPod, settings: DriverPodSettings, log: Any = None) -> None:
        self.spec = pod
        self.settings = settings
        self.log = log or logging.getLogger(__name__)
        self.pod: k8s.V1Pod | None = None  # the live pod this runner follows (``on_kill`` deletes it)

    @cached_property
    def hook(self) -> KubernetesHook:
        return KubernetesHook(conn_id=self.settings.kubernetes_conn_id)

    @cached_property
    def pods(self) -> PodManager:
        return PodManager(kube_client=self.hook.core_v1_client)

    # --- the pod ------------------------------------------------------------------------------

    def pod_request(self, context: Context | None = None) -> k8s.V1Pod:
        """The Pod to create: the ``DriverPod`` (every field of it) plus the task instance's labels
        and a random name suffix per attempt. Applies the deployment's ``pod_mutation_hook``."""
        spec = self.spec
        resources = spec.resources
        pod = k8s.V1Pod(
            api_version="v1",
            kind="Pod",
            metadata=k8s.V1ObjectMeta(
                name=f"{spec.name}-{''.join(secrets.choice(_SUFFIX) for _ in range(8))}",
                namespace=spec.namespace,
                labels={**spec.labels, **ti_labels(context)},
                annotations=dict(spec.annotations),
            ),
            spec=k8s.V1PodSpec(
                restart_policy="Never",
                service_account_name=spec.service_account,
                # The driver talks to the inference endpoint and S3 only, never to the Kubernetes API.
                automount_service_account_token=False,
                active_deadline_seconds=spec.active_deadline_seconds,
                security_context=dict(spec.pod_security_context),
                containers=[
                    k8s.V1Container(
                        name=CONTAINER_NAME,
                        image=spec.image,
                        image_pull_policy=spec.image_pull_policy,
                        command=list(spec.command),
                        args=list(spec.args),
                        env=[_env_var(e) for e in spec.env],
                        ports=[
                            k8s.V1ContainerPort(name=p["name"], container_port=p["containerPort"],
                                                protocol=p.get("protocol", "TCP"))
                            for p in spec.ports
                        ] or None,
                        resources=k8s.V1ResourceRequirements(
                            requests=resources.get("requests"), limits=resources.get("limits")
                        ),
                        security_context=dict(spec.container_security_context),
                        termination_message_policy="File",
                    )
                ],
            ),
        )
        _mutate(pod)
        return pod

    # --- start: create (or reattach) and defer ------------------------------------------------

    def start(self, context: Context) -> dict[str, Any] | None:
        """Create this try's pod (or reattach to this task's running one) and defer on
        ``KubernetesPodTrigger``: raises ``TaskDeferred``. Returns an event to finish with at
        once only when a reattached pod has already finished."""
        request = self.pod_request(context)
        namespace = request.metadata.namespace
        try:
            pod = self._reattach(context, request) or self._create(request)
            self._remember(context, pod)
        except ApiException as exc:
            raise api_failure(exc, f"creating the driver pod in namespace {namespace!r}") from exc
        except _API_ERRORS as exc:
            raise unreachable(exc, f"creating the driver pod in namespace {namespace!r}") from exc
        self.pod = pod
        name = pod.metadata.name
        ti = context["ti"]
        ti.xcom_push(key="pod_name", value=name)
        ti.xcom_push(key="pod_namespace", value=namespace)
        done = finished_status(self._as_dict(pod))
        if done is not None:
            self.log.info("driver pod %s has already finished; not deferring", name)
            return {"status": done, "name": name, "namespace": namespace,
                    "message": f"container {'succeeded' if done == 'success' else 'failed'}"}
        self.defer(name, namespace)
        return None  # not reached: defer raises

    def defer(self, name: str, namespace: str, redefers: int = 0) -> None:
        raise TaskDeferred(
            trigger=KubernetesPodTrigger(**self.trigger_arguments(name, namespace, redefers)),
            method_name=RESUME_METHOD,
        )

    def trigger_arguments(self, name: str, namespace: str, redefers: int = 0) -> dict[str, Any]:
        """``KubernetesPodTrigger``'s keyword arguments (pinned by the provider surface test)."""
        s = self.settings
        return {
            "pod_name": name,
            "pod_namespace": namespace,
            "trigger_start_time": datetime.datetime.now(tz=datetime.UTC),
            "base_container_name": CONTAINER_NAME,
            "kubernetes_conn_id": s.kubernetes_conn_id,
            # The triggerer may not see the worker's connections or kubeconfig: pass both along,
            # as the provider's operator did.
            "connection_extras": self._connection_extras(),
            "config_dict": _kubeconfig_dict(),
            "poll_interval": s.poll_interval_s,
            "get_logs": True,
            "startup_timeout": s.startup_timeout_s,
            "schedule_timeout": s.schedule_timeout_s,
            "on_finish_action": "delete_pod",
            "on_kill_action": "delete_pod",  # a user's kill of the deferred task deletes the pod
            "trigger_kwargs": {REDEFERS_KEY: redefers} if redefers else {},
        }

    def _reattach(self, context: Context, request: k8s.V1Pod) -> k8s.V1Pod | None:
        """This task's pod if it still runs; a finished one is deleted (a new one is created)."""
        pod = self._stored_pod(context) or self._find_pod(request)
        if pod is None:
            return None
        meta, status = pod.metadata, pod.status
        phase = status.phase if status else None
        reason = (status.reason or "").lower() if status else ""
        if phase not in ("Succeeded", "Failed") and reason != "evicted" and not meta.deletion_timestamp:
            self.log.info("reattaching to driver pod %s (phase %s, try %s)", meta.name, phase,
                          (meta.labels or {}).get("try_number"))
            return pod
        self.log.info("found finished driver pod %s (phase %s, reason %s); deleting it and creating a "
                      "new one", meta.name, phase, reason or "-")
        self.pods.delete_pod(pod)
        return None

    def _stored_pod(self, context: Context) -> k8s.V1Pod | None:
        store = context.get("task_state_store")
        if store is None:
            return None
        try:
            stored = store.get(POD_IDENTITY_KEY)
        except Exception as exc:  # noqa: BLE001 - the store only saves a duplicate pod
            self.log.warning("task_state_store unavailable (%s); searching by labels", exc)
            return None
        if not _is_identity(stored):
            return None
        try:
            pod = self.pods.read_pod(_ref(stored["name"], stored["namespace"]))
        except ApiException as exc:
            if exc.status != 404:
                raise
            return None
        if (pod.metadata.labels or {}).get(CHECKED_LABEL) == "True":
            return None
        return pod

    def _find_pod(self, request: k8s.V1Pod) -> k8s.V1Pod | None:
        """This try's pod by its labels (every label names the shard, the run and the try)."""
        labels = request.metadata.labels
        selector = ",".join(
            [f"{k}={v}" for k, v in sorted(labels.items())] + [f"{CHECKED_LABEL}!=True", "!airflow-worker"]
        )
        found = generic_api_retry(self.hook.core_v1_client.list_namespaced_pod)(
            namespace=request.metadata.namespace, label_selector=selector
        ).items
        if not found:
            return None
        oldest = datetime.datetime.min.replace(tzinfo=datetime.UTC)
        found.sort(key=lambda p: p.metadata.creation_timestamp or oldest)
        for extra in found[:-1]:  # duplicates of this try (a create whose reply was lost): keep the newest
            self.log.warning("deleting duplicate driver pod %s of this try", extra.metadata.name)
            self.pods.delete_pod(extra)
        return found[-1]

    def _create(self, request: k8s.V1Pod) -> k8s.V1Pod:
        self.log.info("creating driver pod %s with labels %s", request.metadata.name, request.metadata.labels)
        try:
            return self.pods.create_pod(request)
        except ApiException as exc:
            if exc.status != 409:
                raise
            # Still 409 after the provider's retries: a create whose reply was lost made it.
            try:
                existing = self.pods.read_pod(request)
            except ApiException:
                raise exc from None
            if (existing.metadata.labels or {}) != request.metadata.labels:
                raise
            return existing

    def _remember(self, context: Context, pod: k8s.V1Pod) -> None:
        store = context.get("task_state_store")
        if store is None:
            return
        try:
            store.set(POD_IDENTITY_KEY, {"name": pod.metadata.name, "namespace": pod.metadata.namespace})
        except Exception as exc:  # noqa: BLE001 - the store only saves a duplicate pod
            self.log.warning("could not keep the pod's identity in task_state_store: %s", exc)

    def _connection_extras(self) -> dict[str, Any] | None:
        try:
            return BaseHook.get_connection(self.settings.kubernetes_conn_id).extra_dejson
        except AirflowNotFoundException:
            self.log.warning("connection %r not found; the triggerer resolves it from its own environment",
                             self.settings.kubernetes_conn_id)
            return None

    # --- finish: after the trigger --------------------------------------------------------------

    def finish(self, context: Context, event: dict[str, Any]) -> PodVerdict:
        """Resume after the trigger: wait for the pod's end, read its log, delete it, judge it.

        Raises ``TaskDeferred`` again when the trigger gave up on a pod that still runs (at most
        ``MAX_REDEFERS`` times; then the pod is waited for here, as the provider's operator did).
        """
        status = event.get("status")
        name = event.get("name") or self.spec.name
        namespace = event.get("namespace") or self.spec.namespace
        try:
            pod: k8s.V1Pod | None = self.pods.read_pod(_ref(name, namespace))
        except ApiException as exc:
            if exc.status != 404:
                raise api_failure(exc, f"reading driver pod {name}") from exc
            self.log.warning("driver pod %s/%s is gone (trigger said %s)", namespace, name, status)
            pod = None
        except _API_ERRORS as exc:
            raise unreachable(exc, f"reading driver pod {name}") from exc
        self.pod = pod
        if pod is not None:
            pod = self._follow(pod, status, event)
        lines = self.read_log(pod) if pod is not None else []
        if pod is not None:
            if (pod.status.phase if pod.status else None) != "Succeeded":
                self.log_failure(pod)
            self.delete()
        if status != "success" and event.get("message"):
            self.log.info("the pod trigger reported %s: %s", status, str(event["message"]).splitlines()[0])
        return judge_pod(self._as_dict(pod) if pod is not None else None, lines, name)

    def _follow(self, pod: k8s.V1Pod, status: Any, event: dict[str, Any]) -> k8s.V1Pod | None:
        """Re-defer on a pod that still runs, or wait here for its end (not after a timeout: a pod
        stuck pulling its image or unscheduled never ends)."""
        name, namespace = pod.metadata.name, pod.metadata.namespace
        # "error" (the trigger failed) or a status this trigger does not send (e.g. "running"):
        # follow the pod again if it still runs.
        if (status == "error" or status not in TRIGGER_STATUSES) and still_running(pod, self._as_dict(pod)):
            redefers = int(event.get(REDEFERS_KEY, 0))
            if redefers < MAX_REDEFERS:
                self.log.warning("the pod trigger sent %s (%s) but driver pod %s still runs; deferring "
                                 "again (%d/%d)", status, str(event.get("message", "")).split("\n")[0],
                                 name, redefers + 1, MAX_REDEFERS)
                self.defer(name, namespace, redefers + 1)
            self.log.error("driver pod %s still runs after %d re-deferrals; waiting for it here", name,
                           MAX_REDEFERS)
        if status == "timeout":
            return pod
        try:
            pod = self.pods.await_pod_completion(pod, container_name=CONTAINER_NAME)
        except ApiException as exc:
            if exc.status != 404:
                raise api_failure(exc, f"reading driver pod {name}") from exc
            self.log.warning("driver pod %s vanished while it was waited for", name)
            return None
        except _API_ERRORS as exc:
            raise unreachable(exc, f"reading driver pod {name}") from exc
        self.pod = pod
        return pod

    def read_log(self, pod: k8s.V1Pod) -> list[str]:
        """The container's log, each line also written to the task log (3 tries; the verdict is
        reached without it if it cannot be read). A container that never started has none."""
        state = container_status(self._as_dict(pod)).get("state") or {}
        if "waiting" in state or not state:
            return []
        name, namespace = pod.metadata.name, pod.metadata.namespace
        for attempt in range(3):
            lines: list[str] = []
            stream = None
            try:
                stream = self.hook.get_pod_logs(pod_name=name, container=CONTAINER_NAME, namespace=namespace)
                for raw in stream:
                    for line in raw.decode("utf-8", errors="backslashreplace").splitlines():
                        lines.append(line)
                        self.log.info("[%s] %s", CONTAINER_NAME, line)
                return lines
            except (ApiException, *_API_ERRORS) as exc:
                if attempt == 2 or getattr(exc, "status", None) == 404:
                    self.log.warning("could not read the log of driver pod %s (%s)", name, reason_of(exc))
                    return []
                self.log.warning("reading the log of driver pod %s failed (%s); retrying", name,
                                 reason_of(exc))
                time.sleep(1 + attempt)
            finally:
                if stream is not None and hasattr(stream, "release_conn"):
                    stream.release_conn()
        return []

    def log_failure(self, pod: k8s.V1Pod) -> None:
        """The container's state and the pod's events, for whoever reads the task log."""
        for cs in (pod.status.container_statuses if pod.status else None) or []:
            self.log.info("container %s: %s", cs.name, state_line(cs.state))
        try:
            for ev in self.pods.read_pod_events(pod).items:
                level = logging.WARNING if ev.type == "Warning" else logging.INFO
                self.log.log(level, "pod event: %s - %s", ev.reason, ev.message)
        except Exception as exc:  # noqa: BLE001 - events only explain; never fail on them
            self.log.info("could not read the pod's events (%s)", reason_of(exc))

    def delete(self) -> None:
        """Delete the pod this runner follows (best effort: the verdict does not depend on it)."""
        pod, self.pod = self.pod, None
        if pod is None:
            return
        self.log.info("deleting driver pod %s", pod.metadata.name)
        try:
            self.pods.delete_pod(pod)
        except Exception as exc:  # noqa: BLE001
            self.log.warning("could not delete driver pod %s (%s)", pod.metadata.name, reason_of(exc))

    on_kill = delete

    def _as_dict(self, pod: k8s.V1Pod) -> dict[str, Any]:
        return self.hook.core_v1_client.api_client.sanitize_for_serialization(pod)


def ti_labels(context: Context | None) -> dict[str, str]:
    """The task instance's labels, as the provider sets them (values made label-safe by it)."""
    if not context:
        return {}
    ti = context["ti"]
    labels = {"dag_id": ti.dag_id, "task_id": ti.task_id, "run_id": context["run_id"]}
    if ti.map_index is not None and ti.map_index >= 0:
        labels["map_index"] = str(ti.map_index)
    labels["try_number"] = str(ti.try_number)
    return {k: make_safe_label_value(str(v)) for k, v in labels.items()}


def _is_identity(stored: Any) -> bool:
    return isinstance(stored, dict) and all(isinstance(stored.get(k), str) for k in ("name", "namespace"))


def _ref(name: str, namespace: str) -> k8s.V1Pod:
    return k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=name, namespace=namespace))


def _mutate(pod: k8s.V1Pod) -> None:
    """The deployment's ``pod_mutation_hook`` cluster policy, applied as to the provider's pods."""
    from airflow.settings import pod_mutation_hook

    pod_mutation_hook(pod)


def _kubeconfig_dict() -> dict[str, Any] | None:
    """The worker's ``KUBECONFIG`` file, for a triggerer that lacks it (as the provider did)."""
    path = os.environ.get("KUBECONFIG")
    if not path or not os.path.isfile(path):
        return None
    with open(path) as f:
        return yaml.safe_load(f)


def _env_var(entry: dict[str, Any]) -> k8s.V1EnvVar:
    if "valueFrom" not in entry:
        return k8s.V1EnvVar(name=entry["name"], value=str(entry.get("value", "")))
    ref = entry["valueFrom"]["secretKeyRef"]
    return k8s.V1EnvVar(
        name=entry["name"],
        value_from=k8s.V1EnvVarSource(
            secret_key_ref=k8s.V1SecretKeySelector(
                name=ref["name"], key=ref["key"], optional=ref.get("optional")
            )
        ),
    )
