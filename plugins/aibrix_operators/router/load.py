"""Read an instance's load from vLLM's Prometheus text (``GET /metrics``).

Only three gauges matter, so a line scan beats a full exposition parser (the scrape runs
for every instance every interval, on the router's only core).
"""

from __future__ import annotations

from dataclasses import dataclass

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
# Older vLLM releases named the KV gauge after the GPU.
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"


@dataclass(frozen=True)
class Load:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0


def parse_load(text: str) -> Load:
    """Sum each gauge over its label sets (one per engine / model); KV usage is the max,
    since the fullest engine is the one that preempts."""
    running = waiting = kv = 0.0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = line.find("{")
        if name_end < 0:
            name_end = line.find(" ")
        name = line[:name_end]
        if name not in (RUNNING, WAITING, KV_USAGE, KV_USAGE_OLD):
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if value != value:  # NaN: no information
            continue
        if name == RUNNING:
            running += value
        elif name == WAITING:
            waiting += value
        else:
            kv = max(kv, value)
    return Load(running=running, waiting=waiting, kv_usage=kv)
