"""Prefill -> decode handoff: a kv_producer server saves to Redis, a kv_consumer server loads.

The two servers are separate processes with separate L1 pools; the only thing they share is
the Redis tier. The producer's L2 writes run behind the request, so its answer can come
before its chunks are stored: the decode call carries the ``kv_transfer_params`` the
prefill returned (kvcache.handoff) and the consumer waits until Redis holds those chunks.
So the decode call made right after the prefill answers must load every loadable token and
produce exactly the producer's (single-instance) greedy output; and when the chunks never
arrive, the consumer gives up after ``handoff_wait_s`` and computes the prompt itself.

Through the P/D router (``python -m aibrix_operators.router``, the image's entrypoint) in front
of the same two servers, greedy output equals a single server's (the producer answering the
whole request itself: a producer never loads, so it computes every token), and the decode side
loads the whole handed-off prompt on every first pass. One producer and one consumer serve the
whole module (they were two pairs, in two files: two vLLM starts fewer, issue 36).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kvcache_testlib import LOGPROB_TOL, greedy, random_prompt, scrape, servers_on_one_redis

from aibrix_operators.serving.process import stop_process
from kvcache.launch import REPO, LocalServer, cached_tokens, free_port, kv_transfer_config

pytestmark = pytest.mark.service

BLOCK = 128
LAYERS = 4
WAIT_S = 3.0  # the consumer's handoff_wait_s (the timeout test waits it out once)


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
        stop_process(self.proc, grace_s=15)
        self.log.close()


@pytest.fixture(scope="module")
def pd_pair(tiny_model):
    consumer_metrics = free_port()

    def make(shared: dict[str, Any]) -> tuple[LocalServer, LocalServer]:
        producer = LocalServer(
            tiny_model, kv_config=kv_transfer_config(shared, role="kv_producer"), compact_engine=True
        )
        consumer = LocalServer(
            tiny_model,
            kv_config=kv_transfer_config(
                {**shared, "metrics_port": consumer_metrics, "handoff_wait_s": WAIT_S}, role="kv_consumer"
            ),
            compact_engine=True,
        )
        for server in (producer, consumer):
            # The router reads vLLM's load gauges from /metrics; LocalServer turns stats off.
            server.cmd.remove("--disable-log-stats")
        return producer, consumer

    with servers_on_one_redis(make) as (redis_srv, (producer, consumer)):
        yield producer, consumer, redis_srv, consumer_metrics


@pytest.fixture(scope="module")
def pd_router(pd_pair) -> Iterator[tuple[RouterProcess, LocalServer, int]]:
    """The router in front of the module's pair: (router, the producer, the consumer's metrics port)."""
    producer, consumer, _, consumer_metrics = pd_pair
    router = RouterProcess(producer.url, consumer.url)
    try:
        yield router, producer, consumer_metrics
    finally:
        router.stop()


def _prefill(producer: LocalServer, prompt: list[int]) -> tuple[dict, dict]:
    """The router's prefill call: one token, do_remote_decode. Returns (response, params)."""
    resp = producer.complete(
        prompt, max_tokens=1, logprobs=None, extra={"kv_transfer_params": {"do_remote_decode": True}}
    )
    return resp, resp["kv_transfer_params"]


def test_producer_hands_kv_to_consumer_on_the_first_call(pd_pair) -> None:
    producer, consumer, redis_srv, port = pd_pair
    client = redis_srv.client()
    for i, n in enumerate((1500, 700)):
        prompt = random_prompt(n, seed=900 + i)
        before = scrape(port)
        _, params = _prefill(producer, prompt)
        # What the producer names: every full prompt chunk (the last one's content hash).
        assert params["do_remote_prefill"] is True and params["kvcache"]["chunks"] == n // BLOCK
        decoded = consumer.complete(prompt, max_tokens=16, extra={"kv_transfer_params": params})
        after = scrape(port)
        loadable = (n - 1) // BLOCK * BLOCK
        # Straight after the prefill answered, with no wait on our side: the whole handoff.
        assert after["kvcache_tokens_loaded_total"] - before["kvcache_tokens_loaded_total"] == loadable
        assert (
            after["kvcache_handoffs_total{outcome=complete}"]
            == before.get("kvcache_handoffs_total{outcome=complete}", 0) + 1
        )
        # vLLM's P/D convention: the decode answer reports the prefill side's cache hits.
        assert cached_tokens(decoded) == 0
        single = producer.complete(prompt, max_tokens=16)  # a producer never loads
        text_d, lp_d = greedy(decoded)
        text_p, lp_p = greedy(single)
        assert text_d == text_p  # the same greedy tokens
        # Two processes with different thread pinning: float32 sums may round differently.
        assert max(abs(a - b) for a, b in zip(lp_d, lp_p, strict=True)) <= LOGPROB_TOL
    m = scrape(port)
    assert m["kvcache_hit_chunks_total{tier=l2}"] >= (1500 - 1) // BLOCK + (700 - 1) // BLOCK
    # A consumer does not save: nothing new appears in Redis from its side.
    before_keys = client.dbsize()
    consumer.complete(random_prompt(600, seed=999), max_tokens=2)
    time.sleep(0.5)
    assert client.dbsize() == before_keys


def test_lost_handoff_times_out_into_a_recompute(pd_pair) -> None:
    """The producer's chunks never reach Redis (here: deleted before the decode call, as a
    dropped write-behind or an eviction would): the consumer waits handoff_wait_s, then
    computes the prompt itself, and answers the same tokens."""
    producer, consumer, redis_srv, port = pd_pair
    client = redis_srv.client()
    prompt = random_prompt(900, seed=4321)
    client.flushdb()
    _, params = _prefill(producer, prompt)
    stored = params["kvcache"]["chunks"] * LAYERS
    deadline = time.monotonic() + 30
    while client.dbsize() < stored and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.dbsize() == stored  # every write landed; now lose them all
    client.flushdb()
    before = scrape(port)
    decoded = consumer.complete(prompt, max_tokens=8, extra={"kv_transfer_params": params})
    after = scrape(port)
    assert after["kvcache_tokens_loaded_total"] == before["kvcache_tokens_loaded_total"]
    assert (
        after["kvcache_handoffs_total{outcome=timeout}"]
        == before.get("kvcache_handoffs_total{outcome=timeout}", 0) + 1
    )
    # It waited out handoff_wait_s for the promised chunks before giving up.
    waited = after["kvcache_handoff_wait_seconds_sum"] - before["kvcache_handoff_wait_seconds_sum"]
    assert waited >= WAIT_S
    single = producer.complete(prompt, max_tokens=8)
    assert greedy(decoded)[0] == greedy(single)[0]
    assert max(abs(a - b) for a, b in zip(greedy(decoded)[1], greedy(single)[1], strict=True)) <= LOGPROB_TOL


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


def _loaded(decode_metrics: int) -> float:
    return scrape(decode_metrics)["kvcache_tokens_loaded_total"]


def test_router_output_equals_a_single_server_and_decode_loads_the_prompt(pd_router) -> None:
    router, single, decode_metrics = pd_router
    start = scrape(decode_metrics)  # the consumer served the handoff tests above: counts are deltas
    first_passes: list[tuple[int, int]] = []  # (tokens the decode side loaded, loadable)
    for i, n in enumerate((1100, 600, 2000)):
        body = {"model": single.model, "prompt": random_prompt(n, seed=4200 + i), "max_tokens": 12,
                "temperature": 0.0, "seed": 0, "logprobs": 1}  # fmt: skip
        before = _loaded(decode_metrics)
        routed = router.post("/v1/completions", body)
        loadable = (n - 1) // BLOCK * BLOCK  # every full chunk short of the last prompt token
        first_passes.append((int(_loaded(decode_metrics) - before), loadable))
        direct = single.complete(body["prompt"], max_tokens=12)
        assert cached_tokens(direct) == 0
        _assert_same(routed, direct)
    chat = {"model": single.model, "max_tokens": 10, "temperature": 0.0, "seed": 0, "logprobs": True,
            "messages": [{"role": "user", "content": "routers and caches " * 120}]}  # fmt: skip
    before = _loaded(decode_metrics)
    routed = router.post("/v1/chat/completions", chat)
    # Both calls render the same chat template on the same tokenizer: the same token ids.
    loadable = (routed["usage"]["prompt_tokens"] - 1) // BLOCK * BLOCK
    assert loadable >= BLOCK
    first_passes.append((int(_loaded(decode_metrics) - before), loadable))
    # vLLM's P/D convention: a decode answer reports the prefill side's cache hits (none here).
    assert cached_tokens(routed) == 0
    req = urllib.request.Request(single.url + "/v1/chat/completions", data=json.dumps(chat).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as r:
        _assert_same(routed, json.loads(r.read()), chat=True)
    end = scrape(decode_metrics)
    m = {k: v - start.get(k, 0.0) for k, v in end.items()}
    print(  # the README's figures (pytest -s)
        "decode side, loaded of loadable tokens on first passes:", first_passes,
        "; pending ms per handoff: %.1f" % (1e3 * m["kvcache_handoff_wait_seconds_sum"] / len(first_passes)),
    )  # fmt: skip
    # The whole handoff on every first pass, not what the write-behind happened to have stored.
    assert all(loaded == loadable for loaded, loadable in first_passes)
    assert m["kvcache_handoffs_total{outcome=complete}"] == len(first_passes)
    assert m["kvcache_hit_chunks_total{tier=l2}"] * BLOCK == sum(lo for lo, _ in first_passes)


def test_router_streams_and_reports_its_metrics(pd_router) -> None:
    router, single, _ = pd_router
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
