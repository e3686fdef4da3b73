"""Prefix-aware batching across replicas (docs/prefix-batching.md): two serving replicas
(``kv_both``, no P/D) that share only the kvcache Redis tier. Shards of one prefix group that
land on different replicas reuse each other's prefix KV: replica A answers one question of
the group, replica B another question with the same prefix and loads the prefix from Redis
instead of computing it, with exactly the greedy tokens of a full prefill.

vLLM's own prefix cache is off on both, so every cached token comes from the connector.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from kvcache_testlib import LOGPROB_TOL, RedisServer, greedy, random_prompt, scrape, servers_on_one_redis

from kvcache.launch import LocalServer, cached_tokens, free_port, kv_transfer_config

pytestmark = pytest.mark.service

BLOCK = 128
LAYERS = 4


@pytest.fixture(scope="module")
def replicas(tiny_model: str) -> Iterator[tuple[LocalServer, LocalServer, RedisServer, int]]:
    b_metrics = free_port()

    def make(shared: dict[str, Any]) -> tuple[LocalServer, LocalServer]:
        return (LocalServer(tiny_model, kv_config=kv_transfer_config(shared), compact_engine=True),
                LocalServer(tiny_model, kv_config=kv_transfer_config({**shared, "metrics_port": b_metrics}),
                            compact_engine=True))

    with servers_on_one_redis(make) as (redis_srv, (a, b)):
        yield a, b, redis_srv, b_metrics


def test_a_prefix_computed_on_one_replica_is_loaded_by_another(replicas) -> None:
    a, b, redis_srv, b_port = replicas
    client = redis_srv.client()
    prefix = random_prompt(8 * BLOCK, seed=950)  # the group's shared prefix: 8 whole chunks
    first, second = prefix + random_prompt(40, seed=951), prefix + random_prompt(60, seed=952)
    keys_before = client.dbsize()
    on_a = a.complete(first, max_tokens=4)
    assert cached_tokens(on_a) == 0  # the group's first request computes the prefix
    # A stores behind the request (write-behind): wait for the prefix's chunks, every layer.
    deadline = time.monotonic() + 30
    while client.dbsize() < keys_before + 8 * LAYERS and time.monotonic() < deadline:
        time.sleep(0.05)
    before = scrape(b_port).get("kvcache_tokens_loaded_total", 0.0)
    on_b = b.complete(second, max_tokens=16)
    # Exactly the shared prefix is loaded; the questions differ from there on.
    assert cached_tokens(on_b) == len(prefix)
    assert scrape(b_port)["kvcache_tokens_loaded_total"] - before == len(prefix)
    # The baseline: the same prompt computed in full (another cache_salt shares no KV).
    full = a.complete(second, max_tokens=16, extra={"cache_salt": "baseline"})
    assert cached_tokens(full) == 0
    (tokens, logprobs), (tokens_full, logprobs_full) = greedy(on_b), greedy(full)
    assert tokens == tokens_full
    assert max(abs(x - y) for x, y in zip(logprobs, logprobs_full, strict=True)) <= LOGPROB_TOL
