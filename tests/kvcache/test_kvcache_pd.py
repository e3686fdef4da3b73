"""Prefill -> decode handoff: a kv_producer server saves to Redis, a kv_consumer server loads.

The two servers are separate processes with separate L1 pools; the only thing they share is
the Redis tier. The consumer must report the handed-off tokens as cached and produce
exactly the producer's (single-instance) greedy output.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from kvcache_testlib import RedisServer, greedy, random_prompt, scrape

from kvcache.launch import LocalServer, cached_tokens, free_port, kv_transfer_config

BLOCK = 128
LAYERS = 4


@pytest.fixture(scope="module")
def pd_pair(tiny_model):
    redis_srv = RedisServer().start()
    shared = {"l2_backend": "redis", "l2_redis_url": redis_srv.url}
    consumer_metrics = free_port()
    producer = LocalServer(
        tiny_model, kv_config=kv_transfer_config(shared, role="kv_producer"), threads_bind="0"
    )
    consumer = LocalServer(
        tiny_model,
        kv_config=kv_transfer_config({**shared, "metrics_port": consumer_metrics}, role="kv_consumer"),
        threads_bind="1",
    )
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(), (producer, consumer)))
        yield producer, consumer, redis_srv, consumer_metrics
    finally:
        producer.stop()
        consumer.stop()
        redis_srv.stop()


def test_producer_hands_kv_to_consumer(pd_pair) -> None:
    producer, consumer, redis_srv, port = pd_pair
    client = redis_srv.client()
    for i, n in enumerate((1500, 700)):
        prompt = random_prompt(n, seed=900 + i)
        keys_before = client.dbsize()
        prefill = producer.complete(prompt, max_tokens=16)
        assert cached_tokens(prefill) == 0  # a producer never loads
        chunks = n // BLOCK  # every full prompt chunk is saved, layer by layer
        deadline = time.monotonic() + 30
        while client.dbsize() < keys_before + chunks * LAYERS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.dbsize() == keys_before + chunks * LAYERS
        decoded = consumer.complete(prompt, max_tokens=16)
        assert cached_tokens(decoded) == (n - 1) // BLOCK * BLOCK
        text_d, lp_d = greedy(decoded)
        text_p, lp_p = greedy(prefill)
        assert text_d == text_p  # the same greedy tokens
        # Two processes with different thread pinning: float32 sums may round differently.
        assert max(abs(a - b) for a, b in zip(lp_d, lp_p, strict=True)) < 1e-5
    m = scrape(port)
    assert m["kvcache_hit_chunks_total{tier=l2}"] >= (1500 - 1) // BLOCK + (700 - 1) // BLOCK
    # A consumer does not save: nothing new appears in Redis from its side.
    before = client.dbsize()
    consumer.complete(random_prompt(600, seed=999), max_tokens=2)
    time.sleep(0.5)
    assert client.dbsize() == before
