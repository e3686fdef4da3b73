"""Backend instances, their observed load, and the choice of one for a request.

Selection is a pure function of what the pool knows (health, the last scrape of vLLM's
``/metrics``, the router's own in-flight count), so tests drive it without a network.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

PREFILL = "prefill"
DECODE = "decode"

# Weights of the load score. A waiting request costs more than a running one: it is
# queued behind every running request (on vLLM, usually because the KV cache is full).
# KV usage counts as up to 4 running requests, so an instance close to preempting is
# avoided before its queue grows.
WAITING_WEIGHT = 2.0
KV_USAGE_WEIGHT = 4.0
# A decode instance in the prefill's pod set is taken when its score is within this
# much of the best one (one request's worth), so affinity never piles load on a pod set.
POD_SET_SLACK = 1.0


@dataclass
class Backend:
    """One vLLM instance of one role."""

    url: str
    role: str
    pod_set: str = ""
    healthy: bool = False
    # From the last /metrics scrape (vllm:num_requests_running / _waiting, kv_cache_usage_perc).
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    # Requests this router has sent and not yet seen answered: fresher than any scrape.
    inflight: int = 0
    # Set by discovery; a backend no longer discovered is dropped once idle.
    discovered: bool = field(default=False, repr=False)
    # LoRA adapters loaded through the router that this instance holds: name -> folder
    # (router/adapters.py).
    adapters: dict[str, str] = field(default_factory=dict, repr=False)

    def score(self) -> float:
        # The scrape already counts our in-flight requests, up to a scrape interval late;
        # max() takes whichever is newer without counting them twice.
        return (
            max(self.running, float(self.inflight))
            + WAITING_WEIGHT * self.waiting
            + (KV_USAGE_WEIGHT * self.kv_usage)
        )


def parse_backend(spec: str, role: str) -> Backend:
    """``http://host:port`` or ``http://host:port#pod-set``."""
    url, _, pod_set = spec.strip().partition("#")
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"backend URL must start with http:// or https://: {spec!r}")
    return Backend(url=url, role=role, pod_set=pod_set)


class BackendPool:
    """The instances of both roles, and the choice among them."""

    def __init__(self, backends: list[Backend]) -> None:
        self.backends: list[Backend] = list(backends)
        # Rotates the starting point so equal scores spread requests round-robin.
        self._tick = itertools.count()

    def role(self, role: str) -> list[Backend]:
        return [b for b in self.backends if b.role == role]

    def healthy(self, role: str) -> list[Backend]:
        return [b for b in self.backends if b.role == role and b.healthy]

    def pick(
        self, role: str, prefer_pod_set: str | None = None, exclude: set[str] | None = None
    ) -> Backend | None:
        """The least-loaded healthy instance of ``role``; within ``POD_SET_SLACK`` of the
        best, one in ``prefer_pod_set``. None when no healthy instance is left."""
        cands = [
            b for b in self.backends if b.role == role and b.healthy and not (exclude and b.url in exclude)
        ]
        if not cands:
            return None
        start = next(self._tick) % len(cands)
        cands = cands[start:] + cands[:start]
        best = min(cands, key=Backend.score)
        if prefer_pod_set and best.pod_set != prefer_pod_set:
            local = [b for b in cands if b.pod_set == prefer_pod_set]
            if local:
                near = min(local, key=Backend.score)
                if near.score() <= best.score() + POD_SET_SLACK:
                    return near
        return best

    def replace_discovered(self, role: str, urls: list[str], pod_set: str = "") -> None:
        """Set the discovered instances of ``role`` to ``urls``, keeping known state."""
        known = {b.url: b for b in self.backends if b.role == role and b.discovered}
        keep = [b for b in self.backends if not (b.role == role and b.discovered)]
        for url in urls:
            b = known.pop(url, None) or Backend(url=url, role=role, pod_set=pod_set, discovered=True)
            keep.append(b)
        # An instance gone from DNS with requests in flight stays until they finish.
        keep.extend(b for b in known.values() if b.inflight > 0)
        self.backends = keep
