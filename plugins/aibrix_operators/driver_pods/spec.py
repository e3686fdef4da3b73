"""The batch-driver pod of one shard, as plain data (no Airflow, no Kubernetes client).

``DriverPodSettings`` is what the *deployment* decides (the ``[aibrix_batch]`` section of
the Airflow config, read by ``settings/driver_pods.py``): which cluster connection, image,
Secrets, resources, and which namespaces / service accounts a trigger may pick.
``DriverPodRequest`` is what one shard needs. ``build_driver_pod`` turns both into a
``DriverPod``, which ``operators/driver_pod.py`` creates (adding the task instance's labels)
and ``manifest`` renders as a Pod manifest, for tests and ``kubectl``-style review.

Secrets never become literal values: the S3 credentials and the inference API key are
``env[].valueFrom.secretKeyRef`` references to Secrets the deployment created; the pod
spec, its args and the task log only ever hold the Secret's *name* and *key*.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from aibrix_operators.driver.config import DEFAULT_ENDPOINT_WAIT_S, DriverConfig
from aibrix_operators.trust.policy import TrustViolation

# The CLI in the driver image (inference_images/batch_driver/): same entry point as the Dockerfile's.
DRIVER_COMMAND = ("python", "-m", "aibrix_operators.driver.cli")
CONTAINER_NAME = "base"  # the provider's base-container name: its logs and exit code are the task's
LABEL_PREFIX = "aibrix.ai/"
# boto3's variables, each from the S3 Secret's key of the same name; the first two are required
# when an S3 Secret is configured, the others optional (a region / an S3-compatible endpoint).
S3_SECRET_KEYS = (
    ("AWS_ACCESS_KEY_ID", False),
    ("AWS_SECRET_ACCESS_KEY", False),
    ("AWS_SESSION_TOKEN", True),
    ("AWS_ENDPOINT_URL", True),
    ("AWS_DEFAULT_REGION", True),
)
# The key and the origin it is bound to come from the same Secret, so whoever sets the key also
# decides where it may go (the driver sends it only to OPENAI_API_KEY_ORIGIN); both optional:
# an endpoint that needs no key needs no Secret.
INFERENCE_SECRET_KEYS = (("OPENAI_API_KEY", True), ("OPENAI_API_KEY_ORIGIN", True))
METRICS_PORT_NAME = "metrics"  # the container port a PodMonitor selects (monitoring/kubernetes/)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class DriverPodSettings:
    """Set by the deployment; DAG params can only choose among ``allowed_*``."""

    kubernetes_conn_id: str = "kubernetes_default"
    namespace: str = "default"
    allowed_namespaces: tuple[str, ...] = ()  # empty: only ``namespace``
    service_account: str = "aibrix-batch-driver"
    allowed_service_accounts: tuple[str, ...] = ()  # empty: only ``service_account``
    image: str = "aibrix-batch/batch-driver:0.1.0"  # the package's version, as inference_images/build.py tags
    image_pull_policy: str = "IfNotPresent"
    s3_secret: str | None = "aibrix-batch-s3"
    inference_secret: str | None = "aibrix-batch-inference"
    cpu_request: str = "500m"
    memory_request: str = "512Mi"
    cpu_limit: str | None = None
    memory_limit: str | None = "1Gi"
    # Waiting for a node / for the container to start before the task fails (and is retried).
    schedule_timeout_s: int = 600
    startup_timeout_s: int = 300
    # activeDeadlineSeconds = time left in the completion window + this grace: the driver itself
    # stops at the window's end and records the unstarted requests as batch_expired, which needs
    # a little time after the deadline; the pod's own deadline only backs that up.
    deadline_grace_s: int = 600
    poll_interval_s: float = 2.0
    # The driver serves /metrics here while it runs (0: not served); the pod declares the port and
    # carries the prometheus.io/* annotations, so a PodMonitor or annotation-based scrape finds it.
    metrics_port: int = 9400
    # Where the driver pushes its final totals (a shard shorter than a scrape interval still
    # counts); None: no push.
    pushgateway_url: str | None = None

    def choose_namespace(self, requested: str | None) -> str:
        return _choose(
            requested,
            self.namespace,
            self.allowed_namespaces,
            "allowed_kubernetes_namespaces",
            "kubernetes_namespace",
        )

    def choose_service_account(self, requested: str | None) -> str:
        return _choose(
            requested,
            self.service_account,
            self.allowed_service_accounts,
            "allowed_kubernetes_service_accounts",
            "kubernetes_service_account",
        )


def _choose(requested: str | None, default: str, allowed: tuple[str, ...], rule: str, param: str) -> str:
    if not requested or requested == default:
        return default
    if requested not in allowed:
        raise TrustViolation(
            rule, f"{param} {requested!r} is not one the deployment allows ({', '.join((default, *allowed))})"
        )
    return requested


@dataclass(frozen=True)
class DriverPodRequest:
    """One shard's driver run: the driver's own config travels as itself (``DriverConfig.to_json``,
    read back and checked by the pod's CLI); the rest says which shard and how the pod is made."""

    batch_id: str
    shard_index: int
    shard_uri: str
    results_prefix: str
    total_requests: int
    attempt: int  # Airflow's try_number
    config: DriverConfig  # as the pod runs it (``DriverConfig.for_pod``): deadline required
    model: str | None = None
    endpoint_wait_s: float = DEFAULT_ENDPOINT_WAIT_S
    namespace: str | None = None  # None: the settings' default
    service_account: str | None = None
    memory: str | None = None  # the batch's memory_per_job: request and limit; None: the settings'

    def __post_init__(self) -> None:
        if self.config.deadline is None:
            raise ValueError("a driver pod's config needs the batch's deadline (activeDeadlineSeconds)")
        if self.config.api_key is not None:
            raise ValueError("a driver pod's config carries no API key: use DriverConfig.for_pod()")

    @property
    def deadline(self) -> float:
        assert self.config.deadline is not None
        return self.config.deadline


@dataclass(frozen=True)
class DriverPod:
    """Everything the driver pod is, as plain data (``operators/driver_pod.py`` creates it)."""

    name: str
    namespace: str
    image: str
    image_pull_policy: str
    command: list[str]
    args: list[str]
    env: list[dict[str, Any]]
    labels: dict[str, str]
    annotations: dict[str, str]
    service_account: str
    resources: dict[str, dict[str, str]]
    active_deadline_seconds: int
    pod_security_context: dict[str, Any] = field(default_factory=dict)
    container_security_context: dict[str, Any] = field(default_factory=dict)
    ports: list[dict[str, Any]] = field(default_factory=list)

    def manifest(self) -> dict[str, Any]:
        """The Pod this describes (what the API server receives, less the labels Airflow adds)."""
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": dict(self.labels),
                "annotations": dict(self.annotations),
            },
            "spec": {
                "restartPolicy": "Never",
                "serviceAccountName": self.service_account,
                "automountServiceAccountToken": False,
                "activeDeadlineSeconds": self.active_deadline_seconds,
                "securityContext": self.pod_security_context,
                "containers": [
                    {
                        "name": CONTAINER_NAME,
                        "image": self.image,
                        "imagePullPolicy": self.image_pull_policy,
                        "command": list(self.command),
                        "args": list(self.args),
                        "env": list(self.env),
                        **({"ports": [dict(p) for p in self.ports]} if self.ports else {}),
                        "resources": self.resources,
                        "securityContext": self.container_security_context,
                    }
                ],
            },
        }


def build_driver_pod(
    settings: DriverPodSettings, req: DriverPodRequest, now: float | None = None
) -> DriverPod:
    now = time.time() if now is None else now
    namespace = settings.choose_namespace(req.namespace)
    service_account = settings.choose_service_account(req.service_account)
    args = [
        "--shard-uri", req.shard_uri,
        "--results-prefix", req.results_prefix,
        "--total", str(req.total_requests),
        "--endpoint-wait", _num(req.endpoint_wait_s),
        # One token: the config is the worker's DriverConfig, checked again by the pod's CLI.
        f"--config-json={req.config.for_pod().to_json()}",
    ]  # fmt: skip
    if req.model:
        args += ["--model", req.model]
    env: list[dict[str, Any]] = [{"name": "PYTHONUNBUFFERED", "value": "1"}]  # progress lines as they happen
    if settings.s3_secret:
        env += [_secret_env(name, settings.s3_secret, name, optional) for name, optional in S3_SECRET_KEYS]
    if settings.inference_secret:
        env += [
            _secret_env(name, settings.inference_secret, name, optional)
            for name, optional in INFERENCE_SECRET_KEYS
        ]
    env, ports, annotations = _metrics(settings, env)
    # A batch's memory_per_job is both request and limit: what the pod is scheduled with is what
    # it may use (Guaranteed memory, as AIBrix's job pool sizes a job).
    memory_request = req.memory or settings.memory_request
    memory_limit = req.memory or settings.memory_limit
    resources = {"requests": {"cpu": settings.cpu_request, "memory": memory_request}}
    limits = {k: v for k, v in (("cpu", settings.cpu_limit), ("memory", memory_limit)) if v}
    if limits:
        resources["limits"] = limits
    return DriverPod(
        name=pod_name(req.batch_id, req.shard_index),
        namespace=namespace,
        image=settings.image,
        image_pull_policy=settings.image_pull_policy,
        command=list(DRIVER_COMMAND),
        args=args,
        env=env,
        labels=driver_labels(req.batch_id, req.shard_index, req.attempt),
        annotations={
            f"{LABEL_PREFIX}shard-uri": req.shard_uri,
            f"{LABEL_PREFIX}results-prefix": req.results_prefix,
            **annotations,
        },
        ports=ports,
        service_account=service_account,
        resources=resources,
        active_deadline_seconds=active_deadline_seconds(req.deadline, now, settings.deadline_grace_s),
        # The image runs as uid 65532 (inference_images/batch_driver/Dockerfile) and writes nothing locally.
        pod_security_context={
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "runAsGroup": 65532,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        container_security_context={
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    )


def _metrics(
    settings: DriverPodSettings, env: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, str]]:
    """The driver's metrics: served on the pod's IP (a pod is its own network namespace, so a fixed
    port never collides) and declared for Prometheus; the Pushgateway's address if configured."""
    ports: list[dict[str, Any]] = []
    annotations: dict[str, str] = {}
    if settings.metrics_port:
        port = str(settings.metrics_port)
        env = [*env, {"name": "AIBRIX_DRIVER_METRICS_PORT", "value": port},
               {"name": "AIBRIX_DRIVER_METRICS_ADDR", "value": "0.0.0.0"}]
        ports = [{"name": METRICS_PORT_NAME, "containerPort": settings.metrics_port, "protocol": "TCP"}]
        annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": port,
                       "prometheus.io/path": "/metrics"}
    if settings.pushgateway_url:
        env = [*env, {"name": "AIBRIX_PUSHGATEWAY_URL", "value": settings.pushgateway_url}]
    return env, ports, annotations


def driver_labels(batch_id: str, shard_index: int, attempt: int) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "aibrix-batch-driver",
        "app.kubernetes.io/component": "dispatch",
        f"{LABEL_PREFIX}batch-id": label_value(batch_id),
        f"{LABEL_PREFIX}shard-index": str(shard_index),
        f"{LABEL_PREFIX}attempt": str(attempt),
    }


def pod_name(batch_id: str, shard_index: int) -> str:
    """``aibrix-driver-<batch id tail>-<shard>``; the operator appends a random suffix per attempt."""
    tail = re.sub(r"[^a-z0-9]+", "", batch_id.lower())[-12:] or "batch"
    return f"aibrix-driver-{tail}-{shard_index:05d}"


def label_value(value: str) -> str:
    """A valid label value (≤ 63 of ``[A-Za-z0-9._-]``, alphanumeric at both ends)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", value)[:63].strip("-._")
    return cleaned or "none"


def active_deadline_seconds(deadline: float, now: float, grace_s: int) -> int:
    # At least a minute: a pod started after the window closed still has to record the expiry.
    return max(60, int(deadline - now) + grace_s)


def is_dns_label(name: str) -> bool:
    return bool(_DNS_LABEL.fullmatch(name))


def _secret_env(name: str, secret: str, key: str, optional: bool) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": optional}}}


def _num(value: float) -> str:
    return f"{value:g}"
