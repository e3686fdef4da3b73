"""The connector inside real vLLM CPU servers (tiny random Llama), against a server without it.

One baseline server (no connector) and one connector server (L1 + Redis L2) are shared by
every test in this module. Prefix caching is off in both, so every cached token reported
by the connector server was loaded by the connector.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from kvcache_testlib import RedisServer, greedy, random_prompt, scrape

from kvcache.launch import LocalServer, cached_tokens, free_port, kv_transfer_config

BLOCK = 128
# Tiny model: 4 layers x 2 kv heads x 128 tokens x 128 floats x 4 bytes = 512 KiB per chunk.
CHUNK_BYTES = 4 * 2 * 128 * 128 * 4
L1_CAPACITY = 12 * CHUNK_BYTES


@pytest.fixture(scope="module")
def redis_l2():
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def servers(tiny_model, redis_l2, tmp_path_factory):
    work = tmp_path_factory.mktemp("kv")
    fault = work / "fault"
    metrics_port = free_port()
    extra = {
        "l1_capacity_bytes": L1_CAPACITY,
        "l2_backend": "redis",
        "l2_redis_url": redis_l2.url,
        # Killing Redis refuses connections at once, so the outage test needs no tight
        # timeout; a tight one (0.2 s) timed out on a loaded CI machine, marked Redis
        # down and dropped the writes test_concurrent_shared_and_distinct_prefixes waits for.
        "l2_redis_timeout_s": 2.0,
        "l2_redis_retry_s": 0.5,
        "metrics_port": metrics_port,
        "fault_injection_file": str(fault),
    }
    base = LocalServer(tiny_model, threads_bind="0")
    conn = LocalServer(tiny_model, kv_config=kv_transfer_config(extra), threads_bind="1")
    try:
        with ThreadPoolExecutor(2) as pool:  # start both at once: ~30 s instead of ~60 s
            list(pool.map(lambda s: s.start(), (base, conn)))
        yield base, conn, metrics_port, fault
    finally:
        base.stop()
        conn.stop()


def test_repeated_prompt_is_loaded_and_identical(servers) -> None:
    base, conn, port, _ = servers
    prompt = random_prompt(1100, seed=1)
    first = conn.complete(prompt, max_tokens=16)
    second = conn.complete(prompt, max_tokens=16)
    assert cached_tokens(first) == 0
    # All full chunks except the one holding the last prompt token (that one is computed).
    assert cached_tokens(second) == (1100 - 1) // BLOCK * BLOCK > 0
    assert greedy(second) == greedy(first)  # same tokens, same logprobs (bit-identical KV)
    assert greedy(base.complete(prompt, max_tokens=16)) == greedy(first)
    m = scrape(port)
    assert m["kvcache_tokens_loaded_total"] >= cached_tokens(second)
    assert m["kvcache_hit_chunks_total{tier=l1}"] >= (1100 - 1) // BLOCK


def test_corrupt_load_detected_and_recomputed(servers) -> None:
    _, conn, port, fault = servers
    prompt = random_prompt(900, seed=2)
    first = conn.complete(prompt, max_tokens=16)
    before = scrape(port)["kvcache_integrity_failures_total"]
    fault.write_text("zeros")  # test-only: every loaded payload becomes zeros
    try:
        corrupt = conn.complete(prompt, max_tokens=16)
    finally:
        fault.unlink()
    after = scrape(port)
    assert after["kvcache_integrity_failures_total"] > before
    assert greedy(corrupt) == greedy(first)  # recomputed, not computed from zeros
    again = conn.complete(prompt, max_tokens=16)
    assert cached_tokens(again) > 0 and greedy(again) == greedy(first)


def test_eviction_keeps_l1_under_capacity(servers) -> None:
    base, conn, port, _ = servers
    for i in range(8):  # 8 prompts x 7 chunks = 28 MiB through a 6 MiB pool
        prompt = random_prompt(1000, seed=100 + i)
        got = conn.complete(prompt, max_tokens=4)
        if i % 3 == 0:
            assert greedy(got) == greedy(base.complete(prompt, max_tokens=4))
        m = scrape(port)
        assert m["kvcache_tier_bytes{tier=l1}"] <= L1_CAPACITY
    m = scrape(port)
    assert m["kvcache_evictions_total{tier=l1}"] > 0
    assert m["kvcache_tier_capacity_bytes{tier=l1}"] == L1_CAPACITY


def _wait_for_keys(client, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.dbsize() < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.dbsize() >= count


def test_concurrent_shared_and_distinct_prefixes(servers, redis_l2) -> None:
    base, conn, _, _ = servers
    shared = random_prompt(640, seed=3)
    prompts = [shared + random_prompt(200 + 37 * i, seed=10 + i) for i in range(4)]
    prompts += [random_prompt(700 + 50 * i, seed=20 + i) for i in range(4)]
    expected = [greedy(base.complete(p, max_tokens=8)) for p in prompts]
    keys_before = redis_l2.client().dbsize()
    conn.complete(shared + [5, 6, 7], max_tokens=1)  # store the shared prefix
    _wait_for_keys(redis_l2.client(), keys_before + 5 * 4)  # 5 chunks x 4 layers, written behind
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: conn.complete(p, max_tokens=8), prompts))
    assert [greedy(r) for r in got] == expected
    cached = [cached_tokens(r) for r in got]
    assert all(c >= 640 // BLOCK * BLOCK for c in cached[:4]), (cached, scrape(servers[2]))
    # And again, now every prompt's chunks are stored: all load, all still identical.
    with ThreadPoolExecutor(8) as pool:
        again = list(pool.map(lambda p: conn.complete(p, max_tokens=8), prompts))
    assert [greedy(r) for r in again] == expected
    assert all(cached_tokens(r) > 0 for r in again)


def test_redis_outage_then_recovery(servers, redis_l2) -> None:
    base, conn, port, _ = servers
    prompts = [random_prompt(800, seed=300 + i) for i in range(6)]
    expected = [greedy(base.complete(p, max_tokens=8)) for p in prompts]
    errors_before = sum(v for k, v in scrape(port).items() if k.startswith("kvcache_l2_errors_total"))

    results: list = [None] * len(prompts)

    def run(i: int) -> None:
        results[i] = conn.complete(prompts[i], max_tokens=8)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for i, t in enumerate(threads):
        t.start()
        if i == 2:
            redis_l2.stop()  # killed while requests are in flight
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=120)
    assert [greedy(r) for r in results] == expected
    # With Redis down, the L1 tier still serves repeats.
    again = conn.complete(prompts[0], max_tokens=8)
    assert greedy(again) == expected[0]
    assert sum(v for k, v in scrape(port).items() if k.startswith("kvcache_l2_errors_total")) > errors_before

    redis_l2.start()  # back, empty
    time.sleep(0.6)  # past l2_redis_retry_s
    fresh = random_prompt(1000, seed=400)
    first = conn.complete(fresh, max_tokens=8)
    _wait_for_keys(redis_l2.client(), 7 * 4)  # 7 chunks x 4 layers
    # Push the prompt out of L1 with other prompts, so the next hit must come from Redis.
    for i in range(4):
        conn.complete(random_prompt(1000, seed=500 + i), max_tokens=1)
    l2_hits = scrape(port).get("kvcache_hit_chunks_total{tier=l2}", 0.0)
    hit = conn.complete(fresh, max_tokens=8)
    assert cached_tokens(hit) > 0 and greedy(hit) == greedy(first)
    assert scrape(port)["kvcache_hit_chunks_total{tier=l2}"] > l2_hits
