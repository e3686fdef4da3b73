"""Airflow side of scaling: the deployment's settings and the cluster's API clients.

Settings come from the ``[aibrix_scaling]`` section of the Airflow config (not from
DAG params: which workloads a run may resize is the deployment's call):

* ``roles``: JSON, see ``aibrix_operators.scaling.config``; unset = nothing to scale;
* ``kubernetes_conn_id`` (default ``kubernetes_default``), ``namespace`` (default ``default``);
* ``interval_s``: seconds between the autoscaler's decisions (default 60, at least 10);
* ``pushgateway``: optional Prometheus Pushgateway address for the decision metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aibrix_operators import config_sections
from aibrix_operators.scaling.config import RoleSettings, parse_roles

SECTION = config_sections.SCALING


@dataclass(frozen=True)
class ScalingSettings:
    roles: dict[str, RoleSettings] = field(default_factory=dict)
    kubernetes_conn_id: str = "kubernetes_default"
    namespace: str = "default"
    interval_s: float = 60.0
    pushgateway: str | None = None


def roles_configured() -> bool:
    """Whether the deployment names serving roles to scale at all. The DAG reads it when it is
    parsed: without roles its runs get no scaling tasks (three task runs a batch that would do
    nothing). Presence only: the roles are parsed, and a bad value reported, where they are used."""
    from airflow.sdk import conf

    return bool((conf.get(SECTION, "roles", fallback=None) or "").strip())


def load_scaling_settings() -> ScalingSettings:
    from airflow.sdk import conf

    namespace = conf.get(SECTION, "namespace", fallback=None) or "default"
    return ScalingSettings(
        roles=parse_roles(conf.get(SECTION, "roles", fallback=None), namespace),
        kubernetes_conn_id=conf.get(SECTION, "kubernetes_conn_id", fallback=None) or "kubernetes_default",
        namespace=namespace,
        interval_s=float(conf.get(SECTION, "interval_s", fallback=None) or 60.0),
        pushgateway=conf.get(SECTION, "pushgateway", fallback=None) or None,
    )


def sync_api_client(conn_id: str) -> Any:
    """A ``kubernetes`` ApiClient from an Airflow ``kubernetes`` connection (in-cluster or kubeconfig)."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    return KubernetesHook(conn_id=conn_id).api_client
