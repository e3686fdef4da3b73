"""ResourceQuota admission, as the kube-apiserver's quota plugin answers a pod create.

A namespace's ResourceQuotas (``spec.hard``: ``pods``, ``requests.cpu``/``cpu``,
``requests.memory``/``memory``, ``limits.cpu``, ``limits.memory``) bound the sum over its
non-terminal pods (phase not Succeeded or Failed: a finished pod frees its share, which is how a
quota "frees"). A create that would go over is refused with the API server's own 403 text:

    pods "NAME" is forbidden: exceeded quota: QUOTA, requested: K=V, used: K=V, limited: K=V

(kubernetes/pkg/quota/v1/evaluator, ``admission.go``: the exceeded resources only, sorted,
comma-joined). The driver-pod code reads that text to tell a full quota (retry later) from a
policy refusal (fail now): docs/dispatch.md.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

Obj = dict[str, Any]

QUOTAS = "/api/v1/resourcequotas"
_TERMINAL = ("Succeeded", "Failed")
_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "K": 10**3, "M": 10**6,
           "G": 10**9, "T": 10**12, "m": Decimal("0.001")}  # fmt: skip
# Quota keys and what of a container they add up: (requests or limits, cpu or memory).
_COMPUTE = {
    "cpu": ("requests", "cpu"),
    "requests.cpu": ("requests", "cpu"),
    "memory": ("requests", "memory"),
    "requests.memory": ("requests", "memory"),
    "limits.cpu": ("limits", "cpu"),
    "limits.memory": ("limits", "memory"),
}


class QuotaExceeded(Exception):
    """The 403 message the API server sends for a create over a namespace's quota."""


def quantity(text: str | int | float) -> Decimal:
    """A Kubernetes quantity (``250m``, ``1Gi``, ``2``) as a number (cores or bytes)."""
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text).strip())
    if not m or (m[2] and m[2] not in _SUFFIX):
        raise ValueError(f"not a quantity: {text!r}")
    return Decimal(m[1]) * _SUFFIX.get(m[2], 1)


def render(key: str, value: Decimal) -> str:
    """A quantity as the API server prints it: memory in the largest exact binary unit, CPU in
    cores or millicores, counts as integers."""
    if key.endswith("memory"):
        for suffix in ("Ti", "Gi", "Mi", "Ki"):
            if value and value % _SUFFIX[suffix] == 0:
                return f"{value // _SUFFIX[suffix]}{suffix}"
        return str(int(value))
    if key.endswith("cpu") and value != value.to_integral_value():
        return f"{int(value * 1000)}m"
    return str(int(value))


def usage(pod: Obj) -> dict[str, Decimal]:
    """What one pod counts against each quota key."""
    used = {"pods": Decimal(1)}
    for key, (kind, resource) in _COMPUTE.items():
        used[key] = sum(
            (quantity(((c.get("resources") or {}).get(kind) or {}).get(resource, 0))
             for c in (pod.get("spec") or {}).get("containers") or []),
            Decimal(0),
        )  # fmt: skip
    return used


def status(quota: Obj, pods: list[Obj]) -> Obj:
    """The quota's ``status`` as the quota controller writes it: ``hard`` from the spec, ``used``
    by the namespace's non-terminal pods. The double computes it on each read (a real controller
    lags a little); tests that wait for a quota to be counted or freed read it the same way."""
    live = [p for p in pods if (p.get("status") or {}).get("phase") not in _TERMINAL]
    hard = dict((quota.get("spec") or {}).get("hard") or {})
    used = {k: render(k, sum((usage(p)[k] for p in live), Decimal(0))) for k in hard if k in usage({})}
    return {"hard": hard, "used": used}


def admit_pod(quotas: list[Obj], pods: list[Obj], name: str, pod: Obj) -> None:
    """Raise QuotaExceeded when creating ``pod`` would put any quota over its hard limit."""
    live = [p for p in pods if (p.get("status") or {}).get("phase") not in _TERMINAL]
    wanted = usage(pod)
    for quota in sorted(quotas, key=lambda q: q["metadata"]["name"]):
        hard = {k: quantity(v) for k, v in ((quota.get("spec") or {}).get("hard") or {}).items()}
        over = []
        for key in sorted(hard):
            if key not in wanted:
                continue  # a resource this double does not count: not enforced
            used = sum((usage(p)[key] for p in live), Decimal(0))
            if used + wanted[key] > hard[key]:
                over.append(key)
        if over:
            used_now = {k: sum((usage(p)[k] for p in live), Decimal(0)) for k in over}
            raise QuotaExceeded(
                f'pods "{name}" is forbidden: exceeded quota: {quota["metadata"]["name"]}, '
                f"requested: {_listed(over, wanted)}, used: {_listed(over, used_now)}, "
                f"limited: {_listed(over, hard)}"
            )


def _listed(keys: list[str], values: dict[str, Decimal]) -> str:
    return ",".join(f"{k}={render(k, values[k])}" for k in keys)
