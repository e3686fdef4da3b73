"""The fake OpenAI server itself (tests/fake_openai.py): the raw stub's routes, in process, and
FakeOpenAI's plans by cid and its seeded chaos mix."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests import fake_openai
from tests.fake_openai import FakeOpenAI, RawStub


async def _raw(port: int, request: bytes, want: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    got = await reader.readexactly(want)
    writer.close()
    return got


async def test_the_raw_stub_answers_each_route_with_its_bytes() -> None:
    server = await asyncio.get_running_loop().create_server(RawStub, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        body = b'{"prompt":"x"}'
        post = b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        assert await _raw(port, post, len(fake_openai.COMPLETION)) == fake_openai.COMPLETION
        health = b"GET /health HTTP/1.1\r\n\r\n"
        assert await _raw(port, health * 2, 2 * len(fake_openai.HEALTH)) == fake_openai.HEALTH * 2
        metrics = RawStub.GETS[b"/metrics"]
        assert await _raw(port, b"GET /metrics HTTP/1.1\r\n\r\n", len(metrics)) == metrics
        assert b"vllm:num_requests_waiting" in metrics
        answer = await _raw(port, b"GET /nothing HTTP/1.1\r\n\r\n", len(fake_openai.NOT_FOUND))
        assert answer.startswith(b"HTTP/1.1 404")
    finally:
        server.close()


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, str]:
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.text()


async def test_plans_by_cid_and_the_chaos_mix_is_seeded() -> None:
    server = await FakeOpenAI(plans={"a": ["503", "ok"]}).astart()
    try:
        async with aiohttp.ClientSession() as session:
            assert (await _post(session, server.url, {"model": "x", "cid": "a"}))[0] == 503
            status, text = await _post(session, server.url, {"model": "x", "cid": "a"})
            assert status == 200 and json.loads(text)["choices"][0]["message"]["content"] == "answer a"
            assert json.loads(text)["model"] == "x"
        assert server.counts() == {"a": 2} and dict(server.faults) == {"503": 1}
    finally:
        await server.aclose()

    picks = []
    for _ in range(2):
        chaos = FakeOpenAI(chaos=5)
        picks.append([chaos._action({}, f"c{i}", 1) for i in range(300)])
    assert picks[0] == picks[1] and {p.split("@")[0] for p in picks[0]} >= {"ok", "429", "drop"}
