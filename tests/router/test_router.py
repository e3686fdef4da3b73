"""The P/D router against real aiohttp stub instances on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from aibrix_operators.router.admin import AdminPolicy
from aibrix_operators.router.app import CHECKER, POOL, build_app
from aibrix_operators.router.backends import DECODE, PREFILL, Backend
from aibrix_operators.router.load import parse_load
from tests.router.harness import RouterHarness
from tests.router.stub_backend import StubBackend

COMPLETION = {"model": "m", "prompt": "hello there", "max_tokens": 16, "cache_salt": "tenant-a"}


class Router:
    def __init__(self, server: TestServer, session: aiohttp.ClientSession) -> None:
        self.server = server
        self.session = session
        self.url = str(server.make_url("")).rstrip("/")

    async def post(self, body: dict, path: str = "/v1/completions",
                   headers: dict[str, str] | None = None) -> tuple[int, dict]:
        async with self.session.post(self.url + path, json=body, headers=headers) as r:
            return r.status, json.loads(await r.read())

    async def refresh(self) -> None:
        await self.server.app[CHECKER].refresh()

    async def metrics(self) -> str:
        async with self.session.get(self.url + "/metrics") as r:
            return await r.text()


@pytest.fixture
async def make_router() -> AsyncIterator[Callable[..., object]]:
    harness = RouterHarness()

    async def make(prefill: list[StubBackend], decode: list[StubBackend], sets: dict[str, str] | None = None,
                   extra: list[Backend] | None = None,
                   admin: AdminPolicy | None = None) -> Router:  # fmt: skip
        sets = sets or {}
        for stub in (*prefill, *decode):
            if stub.server is None:
                await stub.start()
        backends = [Backend(s.url, PREFILL, sets.get(s.name, "")) for s in prefill]
        backends += [Backend(s.url, DECODE, sets.get(s.name, "")) for s in decode]
        return Router(*await harness.serve(backends + list(extra or []), [*prefill, *decode], admin=admin))

    yield make
    await harness.close()


async def test_prefill_one_token_then_decode_with_the_same_prompt(make_router) -> None:
    p, d = StubBackend("p"), StubBackend("d")
    router = await make_router([p], [d])
    status, body = await router.post(COMPLETION)
    assert status == 200 and body["from"] == "d"
    [(path_p, pre)], [(path_d, dec)] = p.received, d.received
    assert path_p == path_d == "/v1/completions"
    # The prefill makes one token; everything that shapes the prompt (and so the
    # connector's content keys, cache_salt included) is what decode gets.
    assert pre["max_tokens"] == 1 and pre["stream"] is False
    assert pre["kv_transfer_params"] == {"do_remote_decode": True}
    assert {k: pre[k] for k in ("model", "prompt", "cache_salt")} == {
        k: COMPLETION[k] for k in ("model", "prompt", "cache_salt")
    }
    assert dec == COMPLETION  # decode gets the client's request unchanged


async def test_chat_prefill_limits_completion_tokens_and_drops_output_options(make_router) -> None:
    p, d = StubBackend("p"), StubBackend("d")
    router = await make_router([p], [d])
    chat = {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50,
        "logprobs": True, "top_logprobs": 2, "n": 1, "stream_options": {"include_usage": True},
    }  # fmt: skip
    status, _ = await router.post(chat, "/v1/chat/completions")
    assert status == 200
    pre = p.received[0][1]
    assert pre["max_completion_tokens"] == 1 and "max_tokens" not in pre
    assert not {"logprobs", "top_logprobs", "stream_options"} & set(pre)
    assert pre["messages"] == chat["messages"]
    assert d.received[0][1] == chat


async def test_prefill_transfer_params_reach_decode(make_router) -> None:
    # Connectors that name a transfer (NIXL-style) return parameters from the prefill.
    p = StubBackend("p", extra={"kv_transfer_params": {"remote_block_ids": [1, 2], "remote_host": "h"}})
    d = StubBackend("d")
    router = await make_router([p], [d])
    assert (await router.post(COMPLETION))[0] == 200
    assert d.received[0][1]["kv_transfer_params"] == {"remote_block_ids": [1, 2], "remote_host": "h"}


async def test_least_loaded_decode_is_chosen_and_follows_the_load(make_router) -> None:
    p = StubBackend("p")
    busy, idle = StubBackend("busy", running=6), StubBackend("idle", running=1)
    router = await make_router([p], [busy, idle])
    for _ in range(4):
        assert (await router.post(COMPLETION))[1]["from"] == "idle"
    # Waiting requests weigh more than running ones; KV usage counts too.
    busy.running, idle.running, idle.waiting = 1, 1, 3
    await router.refresh()
    assert (await router.post(COMPLETION))[1]["from"] == "busy"
    busy.waiting, idle.waiting, busy.kv_usage = 0, 0, 0.95
    await router.refresh()
    assert (await router.post(COMPLETION))[1]["from"] == "idle"


async def test_in_flight_requests_spread_between_scrapes(make_router) -> None:
    # Between two scrapes the router's own in-flight count keeps it from sending a burst
    # to the one instance that looked idle.
    p = StubBackend("p")
    a, b = StubBackend("a", stream_pause_s=0.2), StubBackend("b", stream_pause_s=0.2)
    router = await make_router([p], [a, b])

    async def streamed() -> None:
        async with router.session.post(
            router.url + "/v1/completions", json={**COMPLETION, "stream": True}
        ) as r:
            await r.read()

    await asyncio.gather(*(streamed() for _ in range(6)))
    assert (len(a.received), len(b.received)) == (3, 3)


async def test_same_pod_set_preferred_unless_clearly_busier(make_router) -> None:
    p = StubBackend("p")
    near, far = StubBackend("near", running=1), StubBackend("far", running=0)
    router = await make_router([p], [near, far], sets={"p": "set-a", "near": "set-a", "far": "set-b"})
    # One running request of difference is within the slack: stay in the pod set.
    assert (await router.post(COMPLETION))[1]["from"] == "near"
    assert "router_same_pod_set_total 1.0" in await router.metrics()
    near.running = 5
    await router.refresh()
    assert (await router.post(COMPLETION))[1]["from"] == "far"


@pytest.mark.parametrize("status", [400, 404, 422, 429, 500, 503])
async def test_decode_errors_pass_through_with_status_and_body(make_router, status: int) -> None:
    err = {"error": {"message": f"status {status}", "type": "x", "code": status}}
    router = await make_router([StubBackend("p")], [StubBackend("d", answer=(status, err))])
    assert await router.post(COMPLETION) == (status, err)


async def test_a_bad_request_is_answered_by_prefill_and_never_decoded(make_router) -> None:
    err = {"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}}
    p, d = StubBackend("p", answer=(400, err)), StubBackend("d")
    router = await make_router([p], [d])
    assert await router.post(COMPLETION) == (400, err)
    assert d.received == []


@pytest.mark.parametrize("status", [429, 500, 503])
async def test_prefill_infrastructure_failure_falls_back_to_decode(make_router, status: int) -> None:
    p, d = StubBackend("p", answer=(status, {"error": {"message": "busy"}})), StubBackend("d")
    router = await make_router([p], [d])
    status_got, body = await router.post(COMPLETION)
    assert status_got == 200 and body["from"] == "d"
    assert d.received[0][1] == COMPLETION
    assert "router_prefill_fallback_total 1.0" in await router.metrics()


async def test_invalid_json_is_a_400_in_openai_shape(make_router) -> None:
    router = await make_router([StubBackend("p")], [StubBackend("d")])
    async with router.session.post(router.url + "/v1/completions", data=b"{not json") as r:
        assert r.status == 400
        assert (await r.json())["error"]["code"] == "invalid_json"


async def test_streaming_passes_chunks_through_as_they_come(make_router) -> None:
    d = StubBackend("d", stream_chunks=["one", "two", "three"], stream_pause_s=0.3)
    router = await make_router([StubBackend("p")], [d])
    arrivals: list[tuple[float, bytes]] = []
    t0 = time.monotonic()
    async with router.session.post(router.url + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            if line.strip():
                arrivals.append((time.monotonic() - t0, line.strip()))
    texts = [json.loads(line[6:])["choices"][0]["text"] for _, line in arrivals if line != b"data: [DONE]"]
    assert texts == ["one", "two", "three"] and arrivals[-1][1] == b"data: [DONE]"
    # Chunks arrive as the decode instance sends them, not all at the end.
    assert arrivals[1][0] - arrivals[0][0] > 0.2
    assert d.received[0][1]["stream"] is True


async def test_a_dead_decode_instance_is_skipped(make_router) -> None:
    p, alive, doomed = StubBackend("p"), StubBackend("alive"), StubBackend("doomed")
    router = await make_router([p], [alive, doomed])
    doomed_url = doomed.url
    await doomed.close()  # dies after the router saw it healthy: the next call to it fails
    for _ in range(6):
        status, body = await router.post(COMPLETION)
        assert (status, body["from"]) == (200, "alive")
    metrics = await router.metrics()
    assert 'router_backend_healthy{role="decode",url="' + doomed_url + '"} 0.0' in metrics
    assert "router_decode_retries_total 1.0" in metrics  # marked down once, then skipped
    await router.refresh()  # the health loop keeps it out while it stays down
    assert (await router.post(COMPLETION))[1]["from"] == "alive"


async def test_no_healthy_decode_is_503_and_health_says_so(make_router) -> None:
    d = StubBackend("d", healthy=False)
    router = await make_router([StubBackend("p")], [d])
    status, body = await router.post(COMPLETION)
    assert status == 503 and body["error"]["code"] == "no_decode_instance"
    async with router.session.get(router.url + "/health") as r:
        assert r.status == 503
        assert await r.json() == {"prefill": {"healthy": 1, "total": 1}, "decode": {"healthy": 0, "total": 1}}
    d.healthy = True
    await router.refresh()
    assert (await router.post(COMPLETION))[0] == 200


async def test_models_health_and_metrics_endpoints(make_router) -> None:
    router = await make_router([StubBackend("p")], [StubBackend("d")])
    async with router.session.get(router.url + "/v1/models") as r:
        assert r.status == 200 and (await r.json())["data"][0]["id"] == "m"
    async with router.session.get(router.url + "/health") as r:
        assert r.status == 200
    for _ in range(3):
        await router.post(COMPLETION)
    text = await router.metrics()
    assert 'router_requests_total{endpoint="completions",status="200"} 3.0' in text
    assert 'router_request_seconds_count{endpoint="completions"} 3.0' in text
    assert "router_prefill_seconds_count 3.0" in text


def test_load_parser_reads_vllm_gauges() -> None:
    text = (
        "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5\n'
        "vllm:num_requests_swapped garbage\n"
    )
    load = parse_load(text)
    assert (load.running, load.waiting, load.kv_usage) == (5.0, 4.0, 0.5)
    assert parse_load("") == parse_load("vllm:kv_cache_usage_perc NaN\n")


def test_pick_spreads_equal_loads_round_robin() -> None:
    from aibrix_operators.router.backends import BackendPool

    pool = BackendPool([Backend(f"http://d{i}", DECODE, healthy=True) for i in range(3)])
    picks = Counter(pool.pick(DECODE).url for _ in range(30))  # type: ignore[union-attr]
    assert sorted(picks.values()) == [10, 10, 10]
    assert pool.pick(PREFILL) is None


async def test_dns_discovery_finds_instances_behind_a_name() -> None:
    # The cluster shape: instances are a headless Service's A records (here: localhost).
    p, d = await StubBackend("p").start(), await StubBackend("d").start()
    port_p, port_d = p.server.port, d.server.port  # type: ignore[union-attr]
    app = build_app(
        [], health_interval_s=3600, dns={PREFILL: f"localhost:{port_p}", DECODE: f"localhost:{port_d}"}
    )
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(str(server.make_url("/v1/completions")), json=COMPLETION) as r:
                assert r.status == 200 and (await r.json())["from"] == "d"
        pool = app[POOL]
        assert f"http://127.0.0.1:{port_d}" in {b.url for b in pool.healthy(DECODE)}
        assert len(p.received) == 1
    finally:
        await server.close()
        await p.close()
        await d.close()


def test_rediscovery_keeps_state_and_drops_only_idle_instances() -> None:
    from aibrix_operators.router.backends import BackendPool

    pool = BackendPool([Backend("http://static:1", DECODE, healthy=True)])
    pool.replace_discovered(DECODE, ["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
    first, second = (b for b in pool.backends if b.discovered)
    first.healthy, first.running, second.inflight = True, 3, 2
    pool.replace_discovered(DECODE, ["http://10.0.0.1:8000"])  # .2 left DNS with requests in flight
    urls = {b.url: b for b in pool.backends}
    assert urls["http://10.0.0.1:8000"] is first and first.running == 3  # state kept
    assert "http://10.0.0.2:8000" in urls and "http://static:1" in urls
    second.inflight = 0
    pool.replace_discovered(DECODE, ["http://10.0.0.1:8000"])
    assert {b.url for b in pool.backends} == {"http://static:1", "http://10.0.0.1:8000"}


async def test_a_client_leaving_mid_stream_ends_the_upstream_stream(make_router) -> None:
    d = StubBackend("d", stream_chunks=[str(i) for i in range(50)], stream_pause_s=0.05)
    router = await make_router([StubBackend("p")], [d])
    async with aiohttp.ClientSession() as session:
        async with session.post(router.url + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
            await r.content.readline()  # one chunk, then hang up
    for _ in range(100):
        if 'reason="client_gone"' in await router.metrics():
            break
        await asyncio.sleep(0.05)
    assert 'router_upstream_errors_total{reason="client_gone",role="decode"} 1.0' in await router.metrics()
    sent = d.chunks_sent
    await asyncio.sleep(0.3)
    assert d.chunks_sent == sent < 50  # the decode stream was closed, not drained
    assert (await router.post(COMPLETION))[0] == 200  # the router is fine afterwards


@pytest.mark.parametrize("client_params", [
    {"remote_host": "10.6.6.6", "remote_port": 1, "do_remote_prefill": True},  # steer the decode's pull
    "not-an-object", 17, [1, 2], None,
])
async def test_the_router_owns_kv_transfer_params(make_router, client_params) -> None:
    # Issue 19, finding 9: a client's kv_transfer_params reached prefill and decode (a non-object
    # answered 500). The router drops them and sets its own; the request itself is served.
    p = StubBackend("p", extra={"kv_transfer_params": {"remote_block_ids": [7]}})
    d, d_plain = StubBackend("d"), StubBackend("d2")
    router = await make_router([p], [d])
    status, body = await router.post({**COMPLETION, "kv_transfer_params": client_params})
    assert status == 200 and body["from"] == "d"
    [(_, pre)], [(_, dec)] = p.received, d.received
    assert pre["kv_transfer_params"] == {"do_remote_decode": True}
    assert dec == {**COMPLETION, "kv_transfer_params": {"remote_block_ids": [7]}}
    # Without prefill (no prefill instance: decode alone), the client's params are dropped too.
    alone = await make_router([], [d_plain])
    assert (await alone.post({**COMPLETION, "kv_transfer_params": client_params}))[0] == 200
    assert d_plain.received[-1][1] == COMPLETION
