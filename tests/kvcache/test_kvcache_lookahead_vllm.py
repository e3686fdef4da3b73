"""Lookahead prefetch inside real vLLM CPU servers (tiny random Llama), off and on.

Eight requests whose KV is in L2 (Redis) and not in L1 arrive at once at a server that runs
one at a time (``--max-num-seqs 1``): seven wait in vLLM's queue. The connector counts, per
request it loads, where its KV was when the request was scheduled
(``kvcache_load_requests_total{source}``: ``l1`` all of it, ``l2`` some of it). Without the
lookahead every request reads L2; with it, the chunks of the first waiting requests are
fetched into L1 while the running one computes. Answers are compared token for token with
full prefills of the same prompts.

The "off" server produces both prompt sets (their KV goes to L1 and L2); its L1 holds 12
chunks, so the second set's 24 chunks evict the first set's from it, and the first set is
measured there. The "on" server starts with an empty L1 and is measured on the second set.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from kvcache_testlib import RedisServer, completion, random_prompt, scrape

from kvcache.launch import LocalServer, free_port, kv_transfer_config

pytestmark = pytest.mark.service

BLOCK = 128
CHUNK_BYTES = 4 * 2 * 128 * 128 * 4  # 4 layers x 2 kv heads x 128 tokens x 128 floats x 4 bytes
CHUNKS = 3
REQUESTS = 8


def _extra(redis: RedisServer, metrics_port: int, lookahead: int) -> dict[str, Any]:
    return {"l1_capacity_bytes": 12 * CHUNK_BYTES, "l2_backend": "redis", "l2_redis_url": redis.url,
            "l2_redis_timeout_s": 2.0, "metrics_port": metrics_port, "lookahead_requests": lookahead}


def _server(model: str, extra: dict[str, Any]) -> LocalServer:
    return LocalServer(model, kv_config=kv_transfer_config(extra), extra_args=["--max-num-seqs", "1"],
                       compact_engine=True)


def _all_at_once(server: LocalServer, prompts: list[list[int]]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: server.complete(p, max_tokens=16), prompts))


def _sources(port: int) -> dict[str, float]:
    m = scrape(port)
    return {s: m.get(f"kvcache_load_requests_total{{source={s}}}", 0.0) for s in ("l1", "l2")}


def _wait_for_keys(redis: RedisServer, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while redis.client().dbsize() < count:
        assert time.monotonic() < deadline, f"L2 holds {redis.client().dbsize()} of {count} records"
        time.sleep(0.05)


def test_lookahead_prefetch_puts_waiting_requests_kv_in_l1(tiny_model: str) -> None:
    first = [random_prompt(CHUNKS * BLOCK + 5, seed=500 + i) for i in range(REQUESTS)]
    second = [random_prompt(CHUNKS * BLOCK + 5, seed=600 + i) for i in range(REQUESTS)]
    redis = RedisServer().start()
    try:
        port_off, port_on = free_port(), free_port()
        with _server(tiny_model, _extra(redis, port_off, 0)) as off:
            reference = [off.complete(p, max_tokens=16) for p in first + second]
            _wait_for_keys(redis, 2 * REQUESTS * CHUNKS * 4)  # chunks x 4 layers, written behind
            before = _sources(port_off)
            got_off = _all_at_once(off, first)
            after = _sources(port_off)
            off_counts = {s: after[s] - before[s] for s in after}
        with _server(tiny_model, _extra(redis, port_on, 2)) as on:
            got_on = _all_at_once(on, second)
            on_counts = _sources(port_on)
            lookahead = {k: v for k, v in scrape(port_on).items() if k.startswith("kvcache_lookahead_chunks")}
    finally:
        redis.stop()
    for got, want in zip(got_off + got_on, reference, strict=True):
        assert completion(got)[0] == completion(want)[0]
    # Off: every request's KV came from L2. On: most found it in L1 (the first one scheduled
    # cannot: nothing waited before it).
    assert off_counts == {"l1": 0, "l2": REQUESTS}, off_counts
    assert on_counts["l1"] + on_counts["l2"] == REQUESTS, on_counts
    assert on_counts["l1"] >= REQUESTS // 2, (on_counts, lookahead)
    assert lookahead.get("kvcache_lookahead_chunks_total{outcome=stored}", 0) >= on_counts["l1"] * CHUNKS
