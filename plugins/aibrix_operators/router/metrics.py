"""The router's own Prometheus metrics (a private registry, served at ``/metrics``)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .backends import Backend

# Sub-millisecond buckets: the router's own overhead lives there; the top ones cover
# long decodes.
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "router_requests",
            "Requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "router_request_seconds", "Time from request to the end of the answer", ["endpoint"],
            buckets=_BUCKETS, registry=r,
        )  # fmt: skip
        self.prefill_latency = Histogram(
            "router_prefill_seconds", "Time of the prefill call (one token)", buckets=_BUCKETS, registry=r
        )
        self.upstream_errors = Counter(
            "router_upstream_errors", "Failed calls to instances, by role and reason", ["role", "reason"],
            registry=r,
        )  # fmt: skip
        self.prefill_fallback = Counter(
            "router_prefill_fallback",
            "Requests sent to decode without a prefill (no healthy prefill instance, or it failed); "
            "the decode instance computes the prompt itself",
            registry=r,
        )
        self.decode_retries = Counter(
            "router_decode_retries",
            "Decode calls moved to another instance before any answer byte",
            registry=r,
        )
        self.pod_set_hits = Counter(
            "router_same_pod_set", "Decode instance chosen in the prefill's pod set", registry=r
        )
        self.affinity = Counter(
            "router_prefix_affinity",
            "Requests with a prompt of at least one prefix block, by role and affinity outcome: hit (sent "
            "to an instance that took the same prefix), overloaded (every such instance was busier than "
            "the least-loaded by more than the slack), miss (no healthy instance took it)",
            ["role", "outcome"], registry=r,
        )  # fmt: skip
        # labels() takes a lock and a dict lookup; the children are made once.
        self._affinity_children: dict[tuple[str, str], Counter] = {}
        self.inflight = Gauge("router_inflight_requests", "Requests in the router", registry=r)
        self.shed = Counter(
            "aibrix_router_shed", "Batch requests answered 429 so online ones go first (--online-first), "
            "by reason", ["reason"], registry=r,
        )  # fmt: skip
        self.class_inflight = Gauge(
            "aibrix_router_inflight_requests", "Requests forwarded and not yet answered, by class "
            "(--online-first)", ["class"], registry=r,
        )  # fmt: skip
        self.class_waiting = Gauge(
            "aibrix_router_waiting_requests", "Requests queued for a forwarding slot, by class "
            "(--online-first)", ["class"], registry=r,
        )  # fmt: skip
        self.healthy = Gauge(
            "router_backend_healthy", "1 if the instance is healthy", ["role", "url"], registry=r
        )
        self.load = Gauge(
            "router_backend_load_score", "Load score used for selection", ["role", "url"], registry=r
        )

    def watch_admission(self, admission: Any) -> None:
        """Read the admission's counts at scrape time (nothing per request)."""
        for cls in ("online", "batch"):
            self.class_inflight.labels(cls).set_function(lambda c=cls: admission.inflight[c])
            self.class_waiting.labels(cls).set_function(lambda c=cls: admission.waiting(c))

    def affinity_outcome(self, role: str, outcome: str) -> Counter:
        child = self._affinity_children.get((role, outcome))
        if child is None:
            child = self._affinity_children[(role, outcome)] = self.affinity.labels(role, outcome)
        return child

    def observe_backend(self, b: Backend) -> None:
        self.healthy.labels(b.role, b.url).set(1 if b.healthy else 0)
        self.load.labels(b.role, b.url).set(b.score())

    def render(self) -> bytes:
        return generate_latest(self.registry)
