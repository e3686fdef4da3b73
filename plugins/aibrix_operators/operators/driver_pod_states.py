"""What a driver pod's state and the Kubernetes API's errors mean for the task: finished or
not, worth deferring again, and the batch error of an API failure (``DriverPodRunner``'s)."""

from __future__ import annotations

import json
from typing import Any

from airflow.providers.cncf.kubernetes.utils.pod_manager import detect_pod_terminate_early_issues
from kubernetes.client import models as k8s
from kubernetes.client.rest import ApiException

from aibrix_operators.batch.error_codes import BatchFailure
from aibrix_operators.driver_pods.outcome import DriverPodFailure, container_status


def finished_status(pod: dict[str, Any]) -> str | None:
    """``success``/``failed`` when the pod (or its driver container) has ended, else None."""
    phase = (pod.get("status") or {}).get("phase")
    if phase in ("Succeeded", "Failed"):
        return "success" if phase == "Succeeded" else "failed"
    terminated = (container_status(pod).get("state") or {}).get("terminated")
    if terminated:
        return "success" if terminated.get("exitCode") == 0 else "failed"
    return None


def still_running(pod: k8s.V1Pod, as_dict: dict[str, Any]) -> bool:
    """Running, waiting or pending, and not stuck on what never resolves (an image that cannot be
    pulled): the provider operator's rule for deferring again after a trigger error."""
    if finished_status(as_dict) is not None:
        return False
    state = container_status(as_dict).get("state") or {}
    phase = (as_dict.get("status") or {}).get("phase")
    if not ("running" in state or "waiting" in state or phase == "Pending"):
        return False
    return pod.status is None or not detect_pod_terminate_early_issues(pod)


def api_failure(exc: ApiException, doing: str) -> DriverPodFailure:
    """A Kubernetes API error as a batch error. A 403 is not always RBAC: admission answers 403
    too, for a full ResourceQuota (transient: retried) and for a pod its policies refuse
    (PodSecurity, a LimitRange, a missing ServiceAccount: the spec or the namespace must change);
    the API server's own message says which, and goes into the error."""
    reason = f"{exc.status} {exc.reason}".strip()
    said = status_message(exc)
    if exc.status == 403 and "exceeded quota" in said:
        return DriverPodFailure(
            BatchFailure.KUBERNETES_QUOTA_EXCEEDED,
            f"the namespace's ResourceQuota has no room for the driver pod ({said}); the task is retried "
            "and creates it once running pods free the quota (or raise the quota, or lower "
            "[aibrix_batch] driver_memory_request / the batch's memory_per_job)",
            retryable=True,
        )
    if exc.status == 403 and any(mark in said for mark in _ADMISSION_REFUSALS):
        return DriverPodFailure(
            BatchFailure.KUBERNETES_POD_REFUSED,
            f"the Kubernetes API refused the driver pod {doing}: {said}; fix the driver-pod settings "
            "([aibrix_batch] driver_*) or the namespace's policy",
            retryable=False,
        )
    if exc.status in (401, 403):
        return DriverPodFailure(
            BatchFailure.KUBERNETES_FORBIDDEN,
            f"the Kubernetes API refused {doing} ({reason}{': ' + said if said else ''}); the identity of "
            "the Airflow kubernetes connection needs create/get/list/delete on pods and get on pods/log "
            "in that namespace",
            retryable=False,
        )
    return DriverPodFailure(
        BatchFailure.KUBERNETES_API_ERROR, f"the Kubernetes API failed {doing} ({reason})", retryable=True
    )


# What the API server's admission plugins say when they refuse a pod as specified (403, reason
# Forbidden, like RBAC): PodSecurity, LimitRanger, the ServiceAccount admission plugin.
_ADMISSION_REFUSALS = ("violates PodSecurity", "per Container is", "per Pod is",
                       "error looking up service account")


def status_message(exc: ApiException) -> str:
    """The ``message`` of the API server's ``Status`` body, one line; "" when there is none."""
    try:
        body = json.loads(exc.body or "")
    except (TypeError, ValueError):
        return ""
    message = body.get("message") if isinstance(body, dict) else None
    return " ".join(str(message).split())[:500] if message else ""


def unreachable(exc: BaseException, doing: str) -> DriverPodFailure:
    return DriverPodFailure(
        BatchFailure.KUBERNETES_API_ERROR, f"the Kubernetes API failed {doing} ({reason_of(exc)})",
        retryable=True,
    )


def reason_of(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"{exc.status} {exc.reason}".strip()
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def state_line(state: Any) -> str:
    if state is None:
        return "no state"
    if state.terminated:
        t = state.terminated
        return f"terminated (exit {t.exit_code}, reason {t.reason}, message {t.message})"
    if state.waiting:
        return f"waiting ({state.waiting.reason}: {state.waiting.message})"
    if state.running:
        return f"running since {state.running.started_at}"
    return "unknown"
