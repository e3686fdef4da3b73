"""Batch-level Prometheus gauges, pushed by the DAG's tasks at their boundaries.

The batch's tasks live seconds (validate, split, merge) or run in parallel (dispatch), so nothing
stays up to be scraped: each task pushes what it knows to the Pushgateway
(``AIBRIX_PUSHGATEWAY_URL``; unset: nothing is published) into **one group per batch**,
``job="aibrix_batch", batch_id=<id>``, with ``pushadd`` (POST): a push replaces only the metrics
it names, so split's shard count survives merge's push of the final counts. Nothing is pushed per
request; live request-level progress is the drivers' own series (``driver/metrics.py``).

Cardinality is bounded on purpose: the ``batch_id`` label is one series set per *batch* (not per
shard or request), and every batch start (validate) and end (merge) prunes the Pushgateway of
batches that ended — or whose completion window closed — more than
``AIBRIX_BATCH_METRICS_RETENTION_S`` ago (default one hour: long enough for Prometheus to scrape
the final state many times, and for the dashboard's recent-batches table). So the Pushgateway
holds the running batches plus the last hour's finished ones, and Prometheus sees each batch's
series for its lifetime plus that hour.

Concurrent dispatch tasks never read-modify-write a shared value: each one pushes the number of
the batch's shard tasks Airflow counts as finished (a convergent value, exact once the last
shard is done; merge pushes the exact final state anyway). Publishing is best effort: a failure
is logged, never raised — metrics must not fail a batch.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from aibrix_operators.batch.lifecycle import PHASES as LIFECYCLE_PHASES
from aibrix_operators.batch.lifecycle import TERMINAL as LIFECYCLE_TERMINAL

log = logging.getLogger(__name__)

JOB = "aibrix_batch"
URL_ENV = "AIBRIX_PUSHGATEWAY_URL"
RETENTION_ENV = "AIBRIX_BATCH_METRICS_RETENTION_S"
DEFAULT_RETENTION_S = 3600.0
# OpenAI's batch statuses (batch.json's ``status``), as a state set: one series per phase, 1 for the
# current one, like kube-state-metrics' ``kube_pod_status_phase``.
PHASES = tuple(str(p) for p in LIFECYCLE_PHASES)
TERMINAL = frozenset(str(s) for s in LIFECYCLE_TERMINAL)


@dataclass(frozen=True)
class BatchSnapshot:
    """What one task knows about the batch; ``None`` fields are not pushed (the group keeps the
    value an earlier task pushed)."""

    batch_id: str
    phase: str | None = None
    requests: int | None = None
    completed: int | None = None
    failed: int | None = None
    shards: int | None = None
    shards_done: int | None = None
    created_at: float | None = None
    deadline: float | None = None  # end of the completion window, seconds since the epoch

    def __post_init__(self) -> None:
        if self.phase is not None and self.phase not in PHASES:
            raise ValueError(f"phase {self.phase!r} is not one of {PHASES}")


class _SnapshotCollector(Collector):
    def __init__(self, snap: BatchSnapshot, now: float) -> None:
        self.snap, self.now = snap, now

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.snap
        gauges = (
            ("aibrix_batch_requests", "Requests in the batch's input file.", s.requests),
            ("aibrix_batch_requests_completed", "Requests answered successfully (final at merge).",
             s.completed),
            ("aibrix_batch_requests_failed", "Requests that ended as error lines (final at merge).",
             s.failed),
            ("aibrix_batch_shards", "Shards the batch was split into.", s.shards),
            ("aibrix_batch_shards_done", "Shards whose dispatch task finished.", s.shards_done),
            ("aibrix_batch_created_timestamp_seconds", "When the batch was validated (Unix time).",
             s.created_at),
            ("aibrix_batch_deadline_timestamp_seconds", "End of the batch's completion window (Unix "
             "time); seconds left: this minus time().", s.deadline),
        )
        for name, doc, value in gauges:
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=float(value))
        if s.phase is not None:
            phase = GaugeMetricFamily("aibrix_batch_phase", "1 for the batch's current status (OpenAI "
                                      "batch statuses), 0 for the others.", labels=["phase"])
            for p in PHASES:
                phase.add_metric([p], 1.0 if p == s.phase else 0.0)
            yield phase
        yield GaugeMetricFamily("aibrix_batch_last_update_timestamp_seconds",
                                "When a task of the batch last published (Unix time).", value=self.now)


def registry_for(snap: BatchSnapshot, now: float | None = None) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_SnapshotCollector(snap, time.time() if now is None else now))
    return registry


def publish(snap: BatchSnapshot, url: str | None = None, prune_now: bool = False) -> bool:
    """Push the snapshot to the batch's group (and prune old batches first when asked);
    False when not configured or the push failed (logged)."""
    url = url or os.environ.get(URL_ENV)
    if not url:
        return False
    from prometheus_client import pushadd_to_gateway

    if prune_now:
        try:
            prune(url)
        except Exception as exc:  # noqa: BLE001 - a failed prune must not stop this batch's push
            log.warning("could not prune finished batches from %s: %s", url, exc)
    try:
        pushadd_to_gateway(url, job=JOB, grouping_key={"batch_id": snap.batch_id},
                           registry=registry_for(snap), timeout=5)
        return True
    except Exception as exc:  # noqa: BLE001 - observability is best effort
        log.warning("could not push batch metrics of %s to %s: %s", snap.batch_id, url, exc)
        return False


def retention_s() -> float:
    raw = os.environ.get(RETENTION_ENV, "")
    try:
        return float(raw) if raw.strip() else DEFAULT_RETENTION_S
    except ValueError:
        log.warning("%s=%r is not a number of seconds; using %s", RETENTION_ENV, raw, DEFAULT_RETENTION_S)
        return DEFAULT_RETENTION_S


def prune(url: str, now: float | None = None, keep_s: float | None = None) -> list[str]:
    """Delete the groups of batches that ended (or whose window closed) more than ``keep_s`` ago;
    the batch ids deleted."""
    from prometheus_client import delete_from_gateway

    now = time.time() if now is None else now
    keep_s = retention_s() if keep_s is None else keep_s
    with urllib.request.urlopen(url.rstrip("/") + "/api/v1/metrics", timeout=5) as resp:
        groups = json.load(resp).get("data") or []
    deleted = []
    for group in groups:
        labels = group.get("labels") or {}
        if labels.get("job") != JOB or "batch_id" not in labels:
            continue
        if _expired(group, now, keep_s):
            delete_from_gateway(url, job=JOB, grouping_key={"batch_id": labels["batch_id"]}, timeout=5)
            deleted.append(labels["batch_id"])
    if deleted:
        log.info("pruned the metrics of %d finished batch(es) from the Pushgateway", len(deleted))
    return deleted


def _expired(group: dict[str, Any], now: float, keep_s: float) -> bool:
    last = _value(group, "aibrix_batch_last_update_timestamp_seconds")
    if last is None:
        last = _value(group, "push_time_seconds") or now
    phase = next((m["labels"].get("phase") for m in _samples(group, "aibrix_batch_phase")
                  if float(m.get("value", 0)) == 1.0), None)
    if phase in TERMINAL:
        return now - last > keep_s
    # A run killed before it could record its end: gone once its window closed long enough ago.
    deadline = _value(group, "aibrix_batch_deadline_timestamp_seconds")
    return deadline is not None and now - max(deadline, last) > keep_s


def _samples(group: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return (group.get(name) or {}).get("metrics") or []


def _value(group: dict[str, Any], name: str) -> float | None:
    samples = _samples(group, name)
    return float(samples[0]["value"]) if samples else None
