"""LoRA requests through the connector, end to end: one real vLLM CPU server serving two
adapters (written by inference_images/vllm/make_lora.py) and one real Redis.

As in the cache_salt test (test_kvcache_shared_l2.py), the server keeps no L1, so every hit
is a Redis read, and vLLM's own prefix cache is emptied before each request, so any
``cached_tokens`` the server reports were loaded by the connector.

This server keeps vLLM's default engine layout (the model in a worker process of its own), as
deployments run it: the connector's metadata, LoRA ids included, crosses from the engine core to the
worker. The other connector servers of this suite run the compact engine (LocalServer's
``compact_engine``: the model in the engine core, one OpenMP thread), which halves their CPU.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kvcache_testlib import RedisServer, assert_same, completion, load_make_lora, random_prompt, scrape

from kvcache.launch import LocalServer, cached_tokens, free_port, kv_transfer_config

pytestmark = pytest.mark.service

BLOCK = 128
LAYERS = 4
ADAPTERS = {"a1": 1, "a2": 2}  # name -> generator seed


@dataclass
class LoraServer:
    server: LocalServer
    redis: RedisServer
    metrics_port: int

    def fresh(self, prompt: list[int], model: str | None = None) -> dict[str, Any]:
        self.server.reset_prefix_cache()
        return self.server.complete(prompt, max_tokens=8, extra={"model": model} if model else None)

    def l2_hits(self) -> float:
        return scrape(self.metrics_port).get("kvcache_hit_chunks_total{tier=l2}", 0.0)


@pytest.fixture(scope="module")
def lora(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoraServer]:
    make_lora = load_make_lora()
    root = tmp_path_factory.mktemp("loras")
    modules = [
        f"{name}={make_lora(Path(tiny_model), root / name, seed=seed)}" for name, seed in ADAPTERS.items()
    ]
    redis_srv = RedisServer().start()
    port = free_port()
    extra = {
        "l1_capacity_bytes": 0,
        "l2_backend": "redis",
        "l2_redis_url": redis_srv.url,
        "metrics_port": port,
    }
    server = LocalServer(
        tiny_model,
        kv_config=kv_transfer_config(extra),
        prefix_caching=True,
        dev_mode=True,
        max_model_len=2048,
        extra_args=["--enable-lora", "--max-lora-rank", "8", "--lora-modules", *modules],
    )
    try:
        with server:
            yield LoraServer(server, redis_srv, port)
    finally:
        redis_srv.stop()


def _wait_for_keys(lora: LoraServer, n: int, timeout_s: float = 30.0) -> None:
    """L2 writes run behind the request: wait until Redis holds ``n`` records."""
    client = lora.redis.client()
    deadline = time.monotonic() + timeout_s
    while client.dbsize() != n:
        assert time.monotonic() < deadline, f"Redis holds {client.dbsize()} records, want {n}"
        time.sleep(0.05)


def test_adapters_and_base_never_share_blocks(lora: LoraServer) -> None:
    """The same prompt under a1, a2 and the base: each stored under its own keys and none
    a hit for another; a1 again hits its own blocks, with a1's tokens."""
    prompt = random_prompt(700, seed=91)
    per_prompt = 700 // BLOCK * LAYERS
    loadable = (700 - 1) // BLOCK * BLOCK

    a1 = lora.fresh(prompt, "a1")
    assert cached_tokens(a1) == 0
    _wait_for_keys(lora, per_prompt)  # LoRA requests are saved now (they used to bypass)
    hits = lora.l2_hits()
    a2 = lora.fresh(prompt, "a2")
    base = lora.fresh(prompt)
    assert cached_tokens(a2) == 0 and cached_tokens(base) == 0
    assert lora.l2_hits() == hits  # no lookup or load touched another adapter's records
    _wait_for_keys(lora, 3 * per_prompt)
    # The adapters are applied: the three answers differ, so sharing blocks would be wrong.
    tokens = [completion(r)[0] for r in (a1, a2, base)]
    assert len({tuple(t) for t in tokens}) == 3, tokens

    again = lora.fresh(prompt, "a1")
    assert cached_tokens(again) == loadable
    assert lora.l2_hits() == hits + loadable // BLOCK
    assert_same(again, a1)
