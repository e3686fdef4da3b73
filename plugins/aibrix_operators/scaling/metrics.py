"""Prometheus metrics of the scaling decisions (a registry of their own, so a worker can
push them to a Pushgateway; the decision itself stays plain data)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from aibrix_operators.scaling.policy import ScaleDecision

REGISTRY = CollectorRegistry()
DESIRED = Gauge("aibrix_batch_role_desired_replicas", "Replicas the policy asked for, per role",
                ["batch_id", "role"], registry=REGISTRY)
DEADLINE = Gauge("aibrix_batch_role_deadline_replicas", "Replicas the deadline needs, per role",
                 ["batch_id", "role"], registry=REGISTRY)
CAPACITY = Gauge("aibrix_batch_role_capacity_tokens_per_second",
                 "Estimated tokens/s of one replica, per role", ["batch_id", "role"], registry=REGISTRY)
DECISIONS = Counter("aibrix_batch_scale_decisions", "Scaling decisions, by role and reason",
                    ["role", "reason"], registry=REGISTRY)


def record(decision: ScaleDecision, batch_id: str) -> None:
    DESIRED.labels(batch_id, decision.role).set(decision.desired_replicas)
    DEADLINE.labels(batch_id, decision.role).set(decision.deadline_replicas)
    CAPACITY.labels(batch_id, decision.role).set(decision.capacity_per_replica)
    DECISIONS.labels(decision.role, decision.reason).inc()
