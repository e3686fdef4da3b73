"""The P/D router in front of real vLLM CPU servers: a kv_producer (prefill) and a
kv_consumer (decode) that share only the kvcache Redis tier.

Through the router, greedy output equals a single server's (the producer answering the
whole request itself: a producer never loads, so it computes every token), and the decode
side reports the handed-off prompt as loaded by the connector.

The producer writes Redis behind the request (kvcache's write-behind queue) and gives no
signal when a prompt's chunks are stored, so a decode call that arrives first loads only the
chunks already written (measured here: 128 to 2,816 of 512 to 2,944 loadable tokens) and
recomputes the rest. The first pass therefore checks output only; the second pass of the same
request, once Redis holds every chunk, must load every loadable token.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from kvcache_testlib import LOGPROB_TOL, RedisServer, random_prompt, scrape

from kvcache.launch import REPO, LocalServer, cached_tokens, free_port, kv_transfer_config

BLOCK = 128
LAYERS = 4


class RouterProcess:
    """``python -m aibrix_operators.router`` (the image's entrypoint) on 127.0.0.1."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "aibrix_operators.router", "--host", "127.0.0.1",
               "--port", str(self.port), "--prefill", prefill, "--decode", decode,
               "--health-interval-s", "0.5", "--shutdown-timeout-s", "2"]  # fmt: skip
        self.log = open(REPO / ".work" / f"router-{self.port}.log", "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.HTTPError):
                time.sleep(0.1)
        self.stop()
        raise TimeoutError("router not healthy")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def pd_router(tiny_model: str) -> Iterator[tuple[RouterProcess, LocalServer, int, RedisServer]]:
    redis_srv = RedisServer().start()
    shared = {"l2_backend": "redis", "l2_redis_url": redis_srv.url}
    decode_metrics = free_port()
    producer = LocalServer(
        tiny_model, kv_config=kv_transfer_config(shared, role="kv_producer"), threads_bind="0"
    )
    consumer = LocalServer(
        tiny_model,
        kv_config=kv_transfer_config({**shared, "metrics_port": decode_metrics}, role="kv_consumer"),
        threads_bind="1",
    )
    for server in (producer, consumer):
        # The router reads vLLM's load gauges from /metrics; LocalServer turns stats off.
        server.cmd.remove("--disable-log-stats")
    router = None
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(), (producer, consumer)))
        router = RouterProcess(producer.url, consumer.url)
        yield router, producer, decode_metrics, redis_srv
    finally:
        if router is not None:
            router.stop()
        producer.stop()
        consumer.stop()
        redis_srv.stop()


def _tokens_logprobs(resp: dict[str, Any], chat: bool) -> tuple[list[Any], list[float]]:
    lp = resp["choices"][0]["logprobs"]
    if chat:
        return [c["token"] for c in lp["content"]], [float(c["logprob"]) for c in lp["content"]]
    return list(lp["tokens"]), [float(x) for x in lp["token_logprobs"]]


def _assert_same(got: dict[str, Any], want: dict[str, Any], chat: bool = False) -> None:
    (tg, lg), (tw, lw) = _tokens_logprobs(got, chat), _tokens_logprobs(want, chat)
    assert tg == tw  # the same greedy tokens, exactly
    # Decode attends to KV that another process computed (other thread pinning): float32
    # sums may round differently; LOGPROB_TOL's bound is justified in kvcache_testlib.
    assert max(abs(a - b) for a, b in zip(lg, lw, strict=True)) <= LOGPROB_TOL


def _wait_for_keys(redis_srv: RedisServer, count: int) -> None:
    client = redis_srv.client()
    deadline = time.monotonic() + 30
    while client.dbsize() < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.dbsize() >= count


def test_router_output_equals_a_single_server_and_decode_loads_the_prompt(pd_router) -> None:
    router, single, decode_metrics, redis_srv = pd_router
    loaded = 0
    keys = redis_srv.client().dbsize()
    for i, n in enumerate((1100, 600)):
        body = {"model": single.model, "prompt": random_prompt(n, seed=4200 + i), "max_tokens": 12,
                "temperature": 0.0, "seed": 0, "logprobs": 1}  # fmt: skip
        first = router.post("/v1/completions", body)
        loadable = (n - 1) // BLOCK * BLOCK  # every full chunk short of the last prompt token
        assert 0 <= cached_tokens(first) <= loadable  # whatever the write-behind had stored
        keys += n // BLOCK * LAYERS  # the producer saves every full chunk, layer by layer
        _wait_for_keys(redis_srv, keys)
        second = router.post("/v1/completions", body)
        assert cached_tokens(second) == loadable
        loaded += cached_tokens(first) + cached_tokens(second)
        direct = single.complete(body["prompt"], max_tokens=12)
        assert cached_tokens(direct) == 0
        _assert_same(first, direct)
        _assert_same(second, direct)
    chat = {"model": single.model, "max_tokens": 10, "temperature": 0.0, "seed": 0, "logprobs": True,
            "messages": [{"role": "user", "content": "routers and caches " * 120}]}  # fmt: skip
    first = router.post("/v1/chat/completions", chat)
    prompt_tokens = first["usage"]["prompt_tokens"]
    keys += prompt_tokens // BLOCK * LAYERS
    _wait_for_keys(redis_srv, keys)
    routed = router.post("/v1/chat/completions", chat)
    # Both calls render the same chat template on the same tokenizer: the same token ids.
    assert cached_tokens(routed) == (prompt_tokens - 1) // BLOCK * BLOCK >= BLOCK
    loaded += cached_tokens(first) + cached_tokens(routed)
    req = urllib.request.Request(single.url + "/v1/chat/completions", data=json.dumps(chat).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as r:
        _assert_same(routed, json.loads(r.read()), chat=True)
    m = scrape(decode_metrics)
    # The connector on the decode side loaded what the responses report as cached.
    assert m["kvcache_tokens_loaded_total"] == loaded
    # First passes hit Redis; the consumer keeps what it loaded in its L1, where the second
    # passes find it.
    hits = {k: v for k, v in m.items() if k.startswith("kvcache_hit_chunks_total{")}
    assert hits["kvcache_hit_chunks_total{tier=l2}"] > 0
    assert sum(hits.values()) * BLOCK == loaded


def test_router_streams_and_reports_its_metrics(pd_router) -> None:
    router, single, _, _ = pd_router
    body = {"model": single.model, "prompt": random_prompt(400, seed=77), "max_tokens": 6,
            "temperature": 0.0, "stream": True}  # fmt: skip
    req = urllib.request.Request(router.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    text = "".join(
        json.loads(e[6:])["choices"][0]["text"] for e in events[:-1] if json.loads(e[6:])["choices"]
    )
    direct = single.complete(body["prompt"], max_tokens=6, logprobs=None)
    assert text == direct["choices"][0]["text"]
    with urllib.request.urlopen(router.url + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert 'router_requests_total{endpoint="completions",status="200"}' in metrics
    assert "router_prefill_fallback_total 0.0" in metrics
    with urllib.request.urlopen(router.url + "/v1/models", timeout=10) as r:
        assert json.loads(r.read())["data"][0]["id"] == single.model
