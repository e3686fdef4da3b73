"""What the deployment says may be scaled, and how: one ``RoleSettings`` per serving role.

Set by the deployment (the ``[aibrix_scaling] roles`` JSON in the Airflow config), never
by DAG params: which workloads a batch may resize is a trust boundary like endpoints.

    {"prefill": {"kind": "StormService", "name": "llm", "min_replicas": 2, "max_replicas": 16,
                 "gang_size": 2, "nominal_tokens_per_s": 3000},
     "decode":  {"kind": "StormService", "name": "llm", "min_replicas": 2, "max_replicas": 16,
                 "gang_size": 2, "nominal_tokens_per_s": 900, "idle_replicas": 0}}

Any other ``RolePolicy`` field (``startup_s``, ``scale_down_window_s``, ...) may be set
too; ``idle_replicas`` is what the scale-down task leaves after the batch (default 0).
``pod_selector`` (default ``app.kubernetes.io/name=vllm,app.kubernetes.io/component=<role>``,
the labels of both overlays) and ``metrics_port`` (a container port name or number,
default ``http``) say where the role's vLLM ``/metrics`` are scraped.
A role named ``prefill`` gets prefill's defaults (prompt tokens, fast up); any other
role gets decode's (output tokens, conservative).

The plain overlay's roles are ``{"kind": "StatefulSetGroups", "name": "prefill", ...}``:
the StatefulSets ``prefill-g0`` .. ``prefill-g3`` (one per tensor-parallel group, with
its PodGroup), switched on and off whole; ``gang_size`` must be the groups' size
(``GROUP_SIZE``, PodGroup ``minMember``) and ``max_replicas`` at most groups x size.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from aibrix_operators.scaling.kube import ScaleTarget
from aibrix_operators.scaling.load import DEFAULT_PORT, MetricsSource
from aibrix_operators.scaling.policy import RolePolicy

_POLICY_FIELDS = {f.name for f in fields(RolePolicy)} - {"role"}
_PLACE_FIELDS = {"kind", "name", "namespace", "idle_replicas", "pod_selector", "metrics_port"}


@dataclass(frozen=True)
class RoleSettings:
    target: ScaleTarget
    policy: RolePolicy
    metrics: MetricsSource
    idle_replicas: int = 0


def parse_roles(text_or_dict: str | Mapping[str, Any] | None, namespace: str) -> dict[str, RoleSettings]:
    """Parse the deployment's roles; an empty/missing value means "nothing to scale"."""
    if not text_or_dict:
        return {}
    data = json.loads(text_or_dict) if isinstance(text_or_dict, str) else dict(text_or_dict)
    out: dict[str, RoleSettings] = {}
    for role, spec in data.items():
        unknown = set(spec) - _POLICY_FIELDS - _PLACE_FIELDS
        if unknown:
            raise ValueError(f"[aibrix_scaling] roles.{role}: unknown settings {sorted(unknown)}")
        knobs = {k: v for k, v in spec.items() if k in _POLICY_FIELDS}
        make = RolePolicy.prefill if role == "prefill" else RolePolicy.decode
        policy = make(role=role, **knobs)
        target = ScaleTarget.from_dict(role, spec, namespace, group_size=policy.gang_size)
        port = spec.get("metrics_port", DEFAULT_PORT)
        out[role] = RoleSettings(
            target=target,
            policy=policy,
            metrics=MetricsSource(role, target.namespace,
                                  spec.get("pod_selector") or MetricsSource.default_selector(role),
                                  int(port) if str(port).isdigit() else str(port),
                                  rank0_only=policy.gang_size > 1),
            idle_replicas=int(spec.get("idle_replicas", 0)),
        )
    return out
