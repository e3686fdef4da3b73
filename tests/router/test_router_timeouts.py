"""Slow clients against the router process (issue 19, finding 10), over raw sockets.

The router is started the way its image starts it (``python -m aibrix_operators.router``) with
short timeouts, in front of a real aiohttp stub decode instance.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from aibrix_operators.serving.local_vllm import free_port
from aibrix_operators.serving.process import stop_process
from tests.router.stub_backend import StubBackend

pytestmark = pytest.mark.service

REPO = Path(__file__).resolve().parents[2]
IDLE_S = 1.0
BODY_S = 1.0
LINGER_S = 2.0  # router/cli.py
BODY = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 4}).encode()


class RouterProcess:
    def __init__(self, decode_url: str, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aibrix_operators.router", "--host", "127.0.0.1",
             "--port", str(self.port), "--decode", decode_url, "--health-interval-s", "0.5",
             "--idle-timeout-s", str(IDLE_S), "--body-timeout-s", str(BODY_S),
             "--shutdown-timeout-s", "1", *extra],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip

    async def wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, self.proc.stdout.read().decode()
                try:
                    async with session.get(self.url + "/health") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise TimeoutError("the router did not become healthy")

    def stop(self) -> None:
        stop_process(self.proc, grace_s=10)


@pytest.fixture
async def router() -> AsyncIterator[tuple[RouterProcess, StubBackend]]:
    decode = await StubBackend("d").start()
    proc = RouterProcess(decode.url)
    try:
        await proc.wait_ready()
        yield proc, decode
    finally:
        proc.stop()
        await decode.close()


async def _closed_after(reader: asyncio.StreamReader, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    t0 = time.monotonic()
    data = b""
    async with asyncio.timeout(limit_s):
        try:
            while chunk := await reader.read(65536):
                data += chunk
        except ConnectionResetError:  # closed with bytes of ours unread: closed all the same
            pass
    return data, time.monotonic() - t0


async def _complete(router: RouterProcess) -> int:
    async with aiohttp.ClientSession() as session:
        async with session.post(router.url + "/v1/completions", data=BODY,
                                headers={"Content-Type": "application/json"}) as r:  # fmt: skip
            await r.read()
            return r.status


async def test_headers_sent_a_byte_at_a_time_are_cut_off_and_others_are_served(router) -> None:
    proc, decode = router
    reader, writer = await asyncio.open_connection("127.0.0.1", proc.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n")

    async def trickle() -> None:
        # One header byte every 100 ms, forever: without a bound this holds the connection.
        for byte in b"X-Slow: " + b"a" * 1000:
            if writer.is_closing():
                return
            writer.write(bytes([byte]))
            try:
                await writer.drain()
            except ConnectionError:
                return
            await asyncio.sleep(0.1)

    trickler = asyncio.create_task(trickle())
    # A well-behaved client is served while the slow one is connected.
    assert await _complete(proc) == 200
    data, took = await _closed_after(reader, IDLE_S + 5)
    trickler.cancel()
    writer.close()
    assert data == b"" and took < IDLE_S + 3, (data, took)  # closed, nothing routed
    assert [path for path, _ in decode.received] == ["/v1/completions"]  # only the good request


async def test_a_body_sent_a_byte_at_a_time_is_a_408_and_never_routed(router) -> None:
    proc, decode = router
    reader, writer = await asyncio.open_connection("127.0.0.1", proc.port)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(BODY)}\r\n\r\n").encode()  # fmt: skip
    writer.write(head + BODY[:5])
    await writer.drain()

    async def trickle() -> None:
        for byte in BODY[5:-1]:  # never the last byte
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.2)

    trickler = asyncio.create_task(trickle())
    data, took = await _closed_after(reader, BODY_S + LINGER_S + 5)
    trickler.cancel()
    writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 408 Request Timeout", data
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_timeout" and "--body-timeout-s" in error["message"]
    assert took < BODY_S + LINGER_S + 2
    assert decode.received == []
    assert await _complete(proc) == 200  # the router is fine


async def test_idle_connections_close_and_a_prompt_keep_alive_client_is_unaffected(router) -> None:
    proc, decode = router
    reader, writer = await asyncio.open_connection("127.0.0.1", proc.port)
    data, took = await _closed_after(reader, IDLE_S + 5)  # never sends a byte
    writer.close()
    assert data == b"" and IDLE_S * 0.5 < took < IDLE_S + 3, took

    # Requests on one keep-alive connection, each sooner than the idle timeout after the last
    # answer, keep the connection: the bound is per wait, not per connection lifetime.
    created, reused = [], []
    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(lambda *_: _append(created))
    trace.on_connection_reuseconn.append(lambda *_: _append(reused))
    async with aiohttp.ClientSession(trace_configs=[trace]) as session:
        for _ in range(4):
            async with session.post(proc.url + "/v1/completions", data=BODY,
                                    headers={"Content-Type": "application/json"}) as r:  # fmt: skip
                assert r.status == 200
                await r.read()
            await asyncio.sleep(IDLE_S * 0.4)
    assert (len(created), len(reused)) == (1, 3)
    assert len(decode.received) == 4


async def _append(into: list) -> None:
    into.append(1)


async def test_connections_past_the_cap_are_refused_and_the_router_serves_again_below_it() -> None:
    """Bounded in number, not only in time: one client holding idle sockets cannot take them all."""
    decode = await StubBackend("d").start()
    proc = RouterProcess(decode.url, "--max-connections", "4", "--idle-timeout-s", "30")
    held: list[asyncio.StreamWriter] = []
    try:
        await proc.wait_ready()
        await asyncio.sleep(0.3)  # the readiness probe's connection is closed by now
        for _ in range(4):
            _, writer = await asyncio.open_connection("127.0.0.1", proc.port)
            held.append(writer)
        await asyncio.sleep(0.3)
        reader, writer = await asyncio.open_connection("127.0.0.1", proc.port)
        data, took = await _closed_after(reader, 5)
        writer.close()
        status_line, _, rest = data.partition(b"\r\n")
        assert status_line == b"HTTP/1.1 503 Service Unavailable", data
        assert b"Retry-After: 1" in rest and b"too_many_connections" in rest and took < 1, (data, took)
        assert await _complete(proc) == 503  # any new client, until one of the held goes
        held.pop().close()
        await asyncio.sleep(0.3)
        assert await _complete(proc) == 200
        assert [path for path, _ in decode.received] == ["/v1/completions"]  # nothing refused was routed
    finally:
        for writer in held:
            writer.close()
        proc.stop()
        await decode.close()
