"""Prometheus metrics of the batch driver, collected at scrape time.

The driver answers ~7,000 requests/s per core, so the hot path must not pay for metrics:
request outcomes, retries and tokens are already counted by the runner (``_Counters``), the
outage breaker counts its pauses, so a custom collector *reads* those live objects when
Prometheus scrapes, instead of incrementing prometheus-client metrics per request. The only
per-request work is the latency histogram: one ``bisect`` and one list increment
(``LatencyBuckets.observe``), no lock — the driver is one asyncio thread.

Publishing (short-lived shards): the driver serves ``/metrics`` while it runs
(``AIBRIX_DRIVER_METRICS_PORT``; Prometheus scrapes it, in Kubernetes via the pod's port), and,
when ``AIBRIX_PUSHGATEWAY_URL`` is set, pushes its final totals once at the end, so a shard
shorter than a scrape interval still counts. Metric names follow Prometheus conventions
(``_total`` counters, ``_seconds``, base units); labels are low-cardinality (outcome, kind) —
never a shard or request id.
"""

from __future__ import annotations

import bisect
import logging
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# Seconds; LLM requests take 10 ms (cached, short) to minutes (long generations).
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class LatencyBuckets:
    """A histogram without locks or label lookups (single-threaded asyncio use)."""

    __slots__ = ("bounds", "counts", "total", "count")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total += seconds
        self.count += 1

    def merge(self, other: LatencyBuckets) -> None:
        for i, c in enumerate(other.counts):
            self.counts[i] += c
        self.total += other.total
        self.count += other.count

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, c in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += c
            out.append((bound, running))
        return out


class DriverCollector(Collector):
    """Sums the live shards of this process and the ones that finished in it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # shards start/stop on the event loop, scrapes on a thread
        self._live: list[Any] = []  # runner._Counters objects
        self._done = {"completed": 0, "failed": 0, "retries": 0, "input": 0, "output": 0,
                      "outages": 0, "paused_s": 0.0, "shards": 0}
        self._latency = LatencyBuckets()

    def track(self, counters: Any) -> None:
        with self._lock:
            self._live.append(counters)

    def finish(self, counters: Any) -> None:
        with self._lock:
            if counters in self._live:
                self._live.remove(counters)
            for key, value in _snapshot(counters).items():
                self._done[key] += value
            self._done["shards"] += 1
            self._latency.merge(counters.latency)

    def totals(self) -> dict[str, float]:
        with self._lock:
            totals = dict(self._done)
            for c in self._live:
                for key, value in _snapshot(c).items():
                    totals[key] += value
            totals["in_flight"] = sum(c.started - c.completed - c.failed for c in self._live)
            totals["running"] = len(self._live)
            totals["at_risk"] = sum(1 for c in self._live
                                    if getattr(getattr(c, "progress", None), "at_risk", False))
            return totals

    def collect(self) -> Iterator[Any]:
        t = self.totals()
        requests = CounterMetricFamily("aibrix_driver_requests", "Requests answered, by outcome "
                                       "(failed: an error line for a reason of the request's own).",
                                       labels=["outcome"])
        requests.add_metric(["completed"], t["completed"])
        requests.add_metric(["failed"], t["failed"])
        yield requests
        yield CounterMetricFamily("aibrix_driver_retries", "Attempts retried (429/5xx/timeouts).",
                                  value=t["retries"])
        tokens = CounterMetricFamily("aibrix_driver_tokens", "Tokens reported by the server's usage.",
                                     labels=["kind"])
        tokens.add_metric(["input"], t["input"])
        tokens.add_metric(["output"], t["output"])
        yield tokens
        yield GaugeMetricFamily("aibrix_driver_requests_in_flight", "Requests sent and not yet answered.",
                                value=t["in_flight"])
        yield GaugeMetricFamily("aibrix_driver_shards_running", "Shards this process is running.",
                                value=t["running"])
        yield CounterMetricFamily("aibrix_driver_outage_pauses", "Times the breaker paused sending.",
                                  value=t["outages"])
        yield CounterMetricFamily("aibrix_driver_outage_paused_seconds",
                                  "Seconds sending was paused for an endpoint outage.", value=t["paused_s"])
        yield CounterMetricFamily("aibrix_driver_shards_finished", "Shards finished by this process.",
                                  value=t["shards"])
        yield GaugeMetricFamily("aibrix_driver_shards_at_risk", "Running shards that will not finish in "
                                "their batch's window at the throughput measured so far.", value=t["at_risk"])
        yield from _shared_capacity_families()
        latency = LatencyBuckets()
        with self._lock:
            latency.merge(self._latency)
            for c in self._live:
                latency.merge(c.latency)
        yield HistogramMetricFamily("aibrix_driver_request_duration_seconds",
                                    "Time from first send to the request's result line, retries included.",
                                    buckets=latency.cumulative(), sum_value=latency.total)


def _shared_capacity_families() -> Iterator[Any]:
    """Shared mode: each endpoint controller's limit, load view and decisions (capacity/)."""
    from aibrix_operators.capacity.controller import REGISTRY as CONTROLLERS

    labels = ["endpoint"]
    limit = GaugeMetricFamily("aibrix_driver_shared_limit", "Batch requests the endpoint may hold now.",
                              labels=labels)
    in_flight = GaugeMetricFamily("aibrix_driver_shared_in_flight", "Batch requests out at the endpoint.",
                                  labels=labels)
    waiting = GaugeMetricFamily("aibrix_driver_shared_waiting_for_permit",
                                "Batch requests held back by the limit.", labels=labels)
    online = GaugeMetricFamily("aibrix_driver_shared_online_requests",
                               "Online requests the endpoint serves, as the controller estimates them.",
                               labels=labels)
    decisions = CounterMetricFamily("aibrix_driver_shared_decisions",
                                    "Controller ticks by the reason of the limit they set (back-off, "
                                    "growth).",
                                    labels=["endpoint", "reason"])
    for controller in CONTROLLERS.live():
        state, endpoint = controller.state(), [controller.base_url]
        limit.add_metric(endpoint, state["limit"])
        in_flight.add_metric(endpoint, state["in_flight"])
        waiting.add_metric(endpoint, state["waiting"])
        online.add_metric(endpoint, state["online"])
        for reason, ticks in state["reasons"].items():
            decisions.add_metric([controller.base_url, reason], ticks)
    yield from (limit, in_flight, waiting, online, decisions)


def _snapshot(c: Any) -> dict[str, float]:
    health = getattr(c, "health", None)
    return {"completed": c.completed, "failed": c.failed, "retries": c.retries,
            "input": c.usage.input_tokens, "output": c.usage.output_tokens,
            "outages": getattr(health, "outages", 0), "paused_s": getattr(health, "paused_s", 0.0)}


REGISTRY = CollectorRegistry(auto_describe=True)
COLLECTOR = DriverCollector()
REGISTRY.register(COLLECTOR)
_server_started = False
_bound_port: int | None = None


def serve_from_env() -> int | None:
    """Serve /metrics on ``AIBRIX_DRIVER_METRICS_PORT`` (once per process); the bound port, or
    None when not serving."""
    global _server_started, _bound_port
    port = os.environ.get("AIBRIX_DRIVER_METRICS_PORT")
    if _server_started or not port:
        return _bound_port
    from prometheus_client import start_http_server

    addr = os.environ.get("AIBRIX_DRIVER_METRICS_ADDR", "127.0.0.1")
    _server_started = True  # one attempt per process, whatever happens
    try:
        server, _ = start_http_server(int(port), addr=addr, registry=REGISTRY)
    except (OSError, ValueError) as exc:
        # Another worker process on this host holds the port (LocalExecutor runs several):
        # this one still pushes its totals at the end; metrics never fail a shard.
        log.warning("driver metrics not served on %s:%s: %s", addr, port, exc)
        return None
    bound = _bound_port = int(server.server_port)
    log.info("driver metrics on http://%s:%d/metrics", addr, bound)
    return bound


def push_from_env(job: str = "aibrix_driver", grouping: dict[str, str] | None = None) -> bool:
    """Push the totals to ``AIBRIX_PUSHGATEWAY_URL`` if set; a failure is logged, never raised
    (metrics must not fail a batch).

    Grouped by ``instance`` = host:pid: the totals are this process's, so two workers pushing at
    once must not overwrite each other; ``sum()`` over instances is the fleet's total."""
    url = os.environ.get("AIBRIX_PUSHGATEWAY_URL")
    if not url:
        return False
    from prometheus_client import push_to_gateway

    key = grouping or {"instance": f"{socket.gethostname()}:{os.getpid()}"}
    try:
        push_to_gateway(url, job=job, registry=REGISTRY, grouping_key=key, timeout=5)
        return True
    except Exception as exc:  # noqa: BLE001 - observability is best effort
        log.warning("could not push driver metrics to %s: %s", url, exc)
        return False
