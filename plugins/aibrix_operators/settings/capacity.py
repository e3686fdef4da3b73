"""Shared capacity from the ``[aibrix_batch]`` section of the Airflow config (the deployment's).

Keys (all optional; without ``shared_endpoints`` every endpoint is dedicated)::

    [aibrix_batch]
    shared_endpoints = http://vllm-chat:8000, http://pd-router:8080   # also serve online traffic
    shared_batch_priority = 10        # vLLM priority of batch requests (lower runs first)
    shared_online_priority = 0        # what online requests carry (vLLM's default: 0)
    shared_target_inflight = 64       # requests, online + batch, the endpoint holds at a good latency
    shared_max_waiting = 0            # requests queued at the server before it counts as full
    shared_batch_queue = 4            # batch requests that may wait at the server beyond the headroom
    shared_max_kv_usage = 0.95
    shared_ttft_target_s =            # back off when the endpoint's recent TTFT is above this
    shared_tick_s = 0.5               # how often the endpoint's /metrics is read
    shared_preempt_for_online = true  # withdraw batch requests in flight when online ones wait

docs/shared-capacity.md explains each.
"""

from __future__ import annotations

from dataclasses import fields

from aibrix_operators import config_sections
from aibrix_operators.capacity.mode import CapacityRefused, SharedCapacity, choose_capacity
from aibrix_operators.trust.policy import parse_list

SECTION = config_sections.BATCH
_INTEGER_KEYS = ("batch_priority", "online_priority", "target_inflight", "max_waiting", "batch_queue")


def load_shared_capacity() -> tuple[tuple[str, ...], SharedCapacity]:
    """The deployment's shared endpoints and shared-mode settings; a bad value names its key."""
    from airflow.sdk import conf

    endpoints = parse_list(conf.get(SECTION, "shared_endpoints", fallback=None)) or ()
    values: dict[str, object] = {}
    for f in fields(SharedCapacity):
        key = f"shared_{f.name}"
        raw = conf.get(SECTION, key, fallback=None)
        if raw is None or not raw.strip():
            continue
        if f.name == "preempt_for_online":
            values[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
            continue
        kind = int if f.name in _INTEGER_KEYS else float
        try:
            values[f.name] = kind(raw.strip())
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise CapacityRefused(f"[{SECTION}] {key} = {raw!r} is not {what}") from None
    return endpoints, SharedCapacity(**values)  # type: ignore[arg-type]


def capacity_for(endpoint: str, requested: str | None) -> SharedCapacity | None:
    """Shared mode's settings for the endpoint a shard sends to, or ``None`` (dedicated)."""
    endpoints, shared = load_shared_capacity()
    source = f"the [{SECTION}] section of the Airflow config"
    return choose_capacity(endpoint, requested, endpoints, shared, source)
