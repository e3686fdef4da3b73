"""The router image, built from inference_images/router/Dockerfile, routes a request through a
prefill and a decode instance (real aiohttp stubs on 127.0.0.1)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from aibrix_operators.serving.local_vllm import free_port
from tests.images.containers import Detached, inspect
from tests.router.stub_backend import StubBackend

pytestmark = pytest.mark.e2e

COMPLETION = {"model": "m", "prompt": "the router image routes this", "max_tokens": 4}


async def test_the_router_container_sends_prefill_then_decode(router_image):
    p, d = await StubBackend("p").start(), await StubBackend("d").start()
    port = free_port()
    try:
        with Detached(router_image, "--host", "127.0.0.1", "--port", str(port), "--prefill", p.url,
                      "--decode", d.url, "--health-interval-s", "0.2") as router:  # fmt: skip
            async with aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{port}"
                # The stubs answer from this test's loop: wait without blocking it.
                for _ in range(120):
                    try:
                        async with session.get(url + "/health") as resp:
                            if resp.status == 200:
                                break
                    except aiohttp.ClientConnectionError:
                        pass
                    if not router.running():  # a crashing entrypoint fails here with its own last lines
                        raise AssertionError("the router container exited:\n" + router.logs()[-3000:])
                    await asyncio.sleep(0.5)
                else:
                    raise AssertionError("router container never became healthy:\n" + router.logs()[-3000:])
                async with session.post(url + "/v1/completions", json=COMPLETION) as resp:
                    status, body = resp.status, await resp.json()
                async with session.get(url + "/metrics") as resp:
                    metrics = await resp.text()
    finally:
        await p.close()
        await d.close()
    assert status == 200 and body["from"] == "d", body
    [(_, pre)], [(_, dec)] = p.received, d.received
    assert pre["max_tokens"] == 1 and pre["kv_transfer_params"] == {"do_remote_decode": True}
    assert dec == COMPLETION
    assert "router_requests_total{" in metrics  # its own Prometheus metrics counted the request
    assert inspect(router_image, "{{.Config.User}}") == "65532:65532"
