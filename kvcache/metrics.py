"""Prometheus metrics of the connector (prometheus-client, process-global registry).

Both halves of the connector may share a process (vLLM's single-worker executor), so
the metrics are module-level singletons. ``serve(port)`` exposes them from the worker
process; vLLM's own stats hook gets a per-interval summary (see ``KVCacheStats``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server

try:  # vLLM's connector stats hook; absent when used without vLLM (the GPU bench).
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # pragma: no cover - depends on the environment
    KVConnectorStats = object  # type: ignore[misc,assignment]

_LAT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

HITS = Counter("kvcache_hit_chunks", "Chunks loaded from a tier", ["tier"])
LOAD_REQUESTS = Counter(
    "kvcache_load_requests",
    "Requests whose stored KV was loaded when scheduled, by where it was: l1 (all of it), l2 (some)",
    ["source"],
)
LOOKAHEAD_CHUNKS = Counter(
    "kvcache_lookahead_chunks",
    "Lookahead prefetch, per chunk asked: stored (L2 -> L1), absent (not in L2), failed, no_slot,"
    " skipped (after an absent chunk of the same prompt, or already in L1)",
    ["outcome"],
)
MISSES = Counter("kvcache_miss_chunks", "Chunks the worker could not load", ["reason"])
SCHED_QUERY_TOKENS = Counter("kvcache_lookup_tokens", "Prompt tokens looked up by the scheduler")
SCHED_HIT_TOKENS = Counter("kvcache_lookup_hit_tokens", "Prompt tokens the scheduler found stored")
TOKENS_LOADED = Counter("kvcache_tokens_loaded", "Tokens whose KV was loaded into the paged cache")
TOKENS_SAVED = Counter("kvcache_tokens_saved", "Tokens whose KV was saved out of the paged cache")
BYTES_LOADED = Counter("kvcache_bytes_loaded", "Bytes read from a tier", ["tier"])
BYTES_SAVED = Counter("kvcache_bytes_saved", "Bytes written to a tier", ["tier"])
TIER_BYTES = Gauge("kvcache_tier_bytes", "Bytes held by a tier", ["tier"])
TIER_CAPACITY = Gauge("kvcache_tier_capacity_bytes", "Capacity of a tier", ["tier"])
EVICTIONS = Counter("kvcache_evictions", "Chunks evicted", ["tier"])
INTEGRITY_FAILURES = Counter("kvcache_integrity_failures", "Loaded records failing key/layout/checksum")
L2_ERRORS = Counter("kvcache_l2_errors", "L2 operations that failed (tier unreachable)", ["op"])
SAVES_DROPPED = Counter(
    "kvcache_saves_dropped", "Chunk saves not stored because their KV may be wrong", ["reason"]
)
HANDOFFS = Counter(
    "kvcache_handoffs",
    "Decode-side lookups of a prefill handoff, by outcome: complete (every promised chunk "
    "found), timeout (handoff_wait_s passed first), mismatch (another prompt, model or salt), "
    "unavailable (L2 down)",
    ["outcome"],
)
HANDOFF_WAIT_SECONDS = Histogram(
    "kvcache_handoff_wait_seconds",
    "Per handoff: time a decode request stayed pending until its chunks were in L2 (or timeout)",
    buckets=_LAT_BUCKETS,
)
LORA_UNCACHED = Counter(
    "kvcache_lora_uncached_requests",
    "LoRA requests that bypassed the cache because their adapter could not be fingerprinted "
    "(not_local, unreadable, no_weights, too_big)",
    ["reason"],
)
SAVE_ERRORS = Counter("kvcache_save_errors", "Steps whose saves failed and were dropped")
L2_DROPPED = Counter("kvcache_l2_writes_dropped", "L2 writes dropped because the queue was full")
# Both are the forward's cost: time the compute thread spends in the connector's hooks for
# one step's loads / saves (not the wall time from issue to completion, which on a GPU
# overlaps compute).
LOAD_SECONDS = Histogram(
    "kvcache_load_seconds",
    "Per step with loads: compute-thread time in start_load_kv, wait_for_layer_load and the load barrier",
    buckets=_LAT_BUCKETS,
)
SAVE_SECONDS = Histogram(
    "kvcache_save_seconds",
    "Per step with saves: compute-thread time in save_kv_layer and wait_for_save",
    buckets=_LAT_BUCKETS,
)


def record_handoffs(events: list[tuple[str, float]]) -> None:
    """Count P/D handoffs the scheduler resolved (it may run in another process)."""
    for outcome, waited_s in events:
        HANDOFFS.labels(outcome).inc()
        HANDOFF_WAIT_SECONDS.observe(waited_s)


_served: set[int] = set()
_serve_lock = threading.Lock()


def serve(port: int) -> None:
    """Start the metrics HTTP endpoint on 127.0.0.1:port once per process."""
    with _serve_lock:
        if port and port not in _served:
            try:
                start_http_server(port, addr="127.0.0.1")
            except OSError as exc:
                # vLLM's engine core dies of this at start-up and its own last words are "see root
                # cause above": say here which setting to change.
                raise OSError(exc.errno, f"kvcache: metrics_port {port} on 127.0.0.1 cannot be "
                                         f"bound ({exc.strerror}); free it or set another") from exc
            _served.add(port)


@dataclass
class KVCacheStats(KVConnectorStats):  # type: ignore[misc,valid-type]
    """Per-interval counters handed to vLLM's connector stats hook (summed across workers)."""

    data: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.data[name] = self.data.get(name, 0) + value

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: Any) -> KVCacheStats:
        for k, v in other.data.items():
            self.add(k, v)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data
