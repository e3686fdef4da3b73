"""``DriverPodOperator``: the provider's KubernetesPodOperator, running one shard's driver CLI.

Used by ``DispatchShardOperator`` in ``execution_mode=kubernetes`` (composition: the
dispatch task starts this operator's pod and defers on its trigger; on resume it hands
the trigger's event back to ``finish``). What this class adds to the provider's
operator, and why:

* the pod comes from ``driver_pods.spec.DriverPod`` (pure data, unit-tested);
* the pod's log is kept while it is written to the task log, because the driver's
  last JSON line is the shard's outcome (the XCom, as in local mode) — no XCom sidecar,
  which would need ``pods/exec`` rights and a second container;
* the end of the pod is judged by ``driver_pods.outcome.judge_pod``: exit 1 (requests
  with error lines of their own) is a *finished* shard, not a failure; the driver's other
  exit codes, image-pull failures, unschedulable pods, evictions, deadlines and OOM kills
  become specific errors, retryable or not.
"""

from __future__ import annotations

import time
from typing import Any

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk import Context
from kubernetes.client import models as k8s
from kubernetes.client.rest import ApiException

from aibrix_operators.driver_pods.outcome import DriverPodFailure, PodVerdict, container_status, judge_pod
from aibrix_operators.driver_pods.spec import CONTAINER_NAME, DriverPod, DriverPodSettings


class DriverPodOperator(KubernetesPodOperator):
    def __init__(self, *, pod: DriverPod, settings: DriverPodSettings, **kwargs: Any) -> None:
        resources = pod.resources
        super().__init__(
            kubernetes_conn_id=settings.kubernetes_conn_id,
            namespace=pod.namespace,
            name=pod.name,
            image=pod.image,
            image_pull_policy=pod.image_pull_policy,
            cmds=list(pod.command),
            arguments=list(pod.args),
            env_vars=[_env_var(e) for e in pod.env],
            ports=[k8s.V1ContainerPort(name=p["name"], container_port=p["containerPort"],
                                       protocol=p.get("protocol", "TCP")) for p in pod.ports],
            labels=dict(pod.labels),
            annotations=dict(pod.annotations),
            service_account_name=pod.service_account,
            # The driver talks to the inference endpoint and S3 only, never to the Kubernetes API.
            automount_service_account_token=False,
            container_resources=k8s.V1ResourceRequirements(
                requests=resources.get("requests"), limits=resources.get("limits")
            ),
            active_deadline_seconds=pod.active_deadline_seconds,
            security_context=pod.pod_security_context,
            container_security_context=pod.container_security_context,
            base_container_name=CONTAINER_NAME,
            deferrable=True,
            get_logs=True,
            do_xcom_push=False,
            schedule_timeout_seconds=settings.schedule_timeout_s,
            startup_timeout_seconds=settings.startup_timeout_s,
            poll_interval=settings.poll_interval_s,
            on_finish_action="delete_pod",
            log_events_on_failure=True,
            # The spec holds no secret values, but it is long; the verdict says what went wrong.
            log_pod_spec_on_failure=False,
            **kwargs,
        )
        self._log_lines: list[str] = []

    def start(self, context: Context) -> None:
        """Create the pod (or find this try's) and defer: raises ``TaskDeferred``."""
        try:
            self.execute_async(context)
        except ApiException as exc:
            raise api_failure(exc, f"creating the driver pod in namespace {self.namespace!r}") from exc

    def finish(self, context: Context, event: dict[str, Any]) -> PodVerdict:
        """Resume after the trigger: read the log, clean the pod up, judge its end.

        May raise ``TaskDeferred`` again (the provider re-defers when its trigger gave up on a
        pod that is still running).
        """
        self._log_lines = []
        name = event.get("name", self.name or "?")
        try:
            super().trigger_reentry(context, event)
        except ApiException as exc:
            if exc.status != 404:
                raise api_failure(exc, f"reading driver pod {name}") from exc
            self.pod = None
        except Exception as exc:  # noqa: BLE001 - the provider's failures are re-judged from the pod itself
            self.log.info("the pod operator reported: %s", str(exc).splitlines()[0] if str(exc) else exc)
        pod = self.client.api_client.sanitize_for_serialization(self.pod) if self.pod is not None else None
        return judge_pod(pod, self._log_lines, name)

    # Keep the lines the provider writes to the task log: the last JSON one is the outcome.
    def _write_logs(self, pod: k8s.V1Pod, follow: bool = False, since_time: Any = None) -> None:
        state = container_status(self.client.api_client.sanitize_for_serialization(pod)).get("state") or {}
        if "waiting" in state or not state:
            return  # the container never started: there is no log to read
        for attempt in range(3):
            lines: list[str] = []
            try:
                stream = self.client.read_namespaced_pod_log(
                    name=pod.metadata.name,
                    namespace=pod.metadata.namespace,
                    container=CONTAINER_NAME,
                    follow=follow,
                    timestamps=False,
                    _preload_content=False,
                )
                for raw in stream:
                    for line in raw.decode("utf-8", errors="backslashreplace").splitlines():
                        lines.append(line)
                        self.log.info("[%s] %s", CONTAINER_NAME, line)
                self._log_lines = lines
                return
            except ApiException as exc:
                if attempt == 2 or exc.status == 404:
                    raise
                self.log.warning("reading the pod log failed (%s %s); retrying", exc.status, exc.reason)
                time.sleep(1 + attempt)


def api_failure(exc: ApiException, doing: str) -> DriverPodFailure:
    """A Kubernetes API error as a batch error: 401/403 need a person (RBAC), others may pass."""
    reason = f"{exc.status} {exc.reason}".strip()
    if exc.status in (401, 403):
        return DriverPodFailure(
            "kubernetes_forbidden",
            f"the Kubernetes API refused {doing} ({reason}); the identity of the Airflow kubernetes "
            "connection needs create/get/list/delete on pods and get on pods/log in that namespace",
            retryable=False,
        )
    return DriverPodFailure(
        "kubernetes_api_error", f"the Kubernetes API failed {doing} ({reason})", retryable=True
    )


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
