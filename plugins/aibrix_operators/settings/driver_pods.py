"""Driver-pod settings from the ``[aibrix_batch]`` section of the Airflow config (the deployment's).

Keys (all optional; defaults in ``DriverPodSettings``)::

    [aibrix_batch]
    kubernetes_conn_id = kubernetes_default      # Airflow "kubernetes" connection: in-cluster or kubeconfig
    kubernetes_namespace = batch                 # where driver pods run
    allowed_kubernetes_namespaces = batch-b      # others a trigger may pick with the param
    kubernetes_service_account = aibrix-batch-driver
    allowed_kubernetes_service_accounts =
    driver_image = registry.example.com/aibrix-batch/batch-driver@sha256:...
    driver_image_pull_policy = IfNotPresent
    driver_s3_secret = aibrix-batch-s3           # empty: no S3 Secret (workload identity instead)
    driver_inference_secret = aibrix-batch-inference
    driver_cpu_request = 500m
    driver_memory_request = 512Mi
    driver_cpu_limit =
    driver_memory_limit = 1Gi
    driver_schedule_timeout_s = 600
    driver_startup_timeout_s = 300
    driver_deadline_grace_s = 600
    driver_poll_interval_s = 2
    driver_metrics_port = 9400                   # /metrics in the pod (0: off); docs/metrics.md
    driver_pushgateway_url = http://pushgateway.monitoring:9091   # empty: no push
    dispatch_pool = aibrix_dispatch              # read when the DAG is parsed

None of these is a DAG param: the image is the code that runs with the pod's identity, the
Secrets are the identity, and the connection is the cluster — a trigger must not choose them.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from aibrix_operators import config_sections
from aibrix_operators.driver_pods.spec import DriverPodSettings
from aibrix_operators.trust.policy import parse_list

SECTION = config_sections.BATCH
# config key -> DriverPodSettings field
_KEYS = {
    "kubernetes_conn_id": "kubernetes_conn_id",
    "kubernetes_namespace": "namespace",
    "allowed_kubernetes_namespaces": "allowed_namespaces",
    "kubernetes_service_account": "service_account",
    "allowed_kubernetes_service_accounts": "allowed_service_accounts",
    "driver_image": "image",
    "driver_image_pull_policy": "image_pull_policy",
    "driver_s3_secret": "s3_secret",
    "driver_inference_secret": "inference_secret",
    "driver_cpu_request": "cpu_request",
    "driver_memory_request": "memory_request",
    "driver_cpu_limit": "cpu_limit",
    "driver_memory_limit": "memory_limit",
    "driver_schedule_timeout_s": "schedule_timeout_s",
    "driver_startup_timeout_s": "startup_timeout_s",
    "driver_deadline_grace_s": "deadline_grace_s",
    "driver_poll_interval_s": "poll_interval_s",
    "driver_metrics_port": "metrics_port",
    "driver_pushgateway_url": "pushgateway_url",
}
DEFAULT_POOL = "default_pool"


def load_driver_pod_settings() -> DriverPodSettings:
    from airflow.sdk import conf

    types = {f.name: f.type for f in fields(DriverPodSettings)}
    defaults = {f.name: f.default for f in fields(DriverPodSettings)}
    values: dict[str, Any] = {}
    for key, name in _KEYS.items():
        raw = conf.get(SECTION, key, fallback=None)
        if raw is None or (not raw.strip() and defaults[name] is not None and "tuple" not in str(types[name])
                           and name not in ("s3_secret", "inference_secret", "memory_limit")):
            continue  # an empty value switches off only what may be off (a Secret, a limit)
        kind = str(types[name])
        if "tuple" in kind:
            values[name] = parse_list(raw) or ()
        elif kind.startswith("int"):
            values[name] = int(raw)
        elif kind.startswith("float"):
            values[name] = float(raw)
        else:
            values[name] = raw.strip() or None  # an empty value switches an optional Secret/limit off
    return DriverPodSettings(**values)


def dispatch_pool() -> str:
    """The pool bounding concurrent dispatch tasks (and so driver pods); read at DAG parse time."""
    from airflow.sdk import conf

    return conf.get(SECTION, "dispatch_pool", fallback=None) or DEFAULT_POOL
