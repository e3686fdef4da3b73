"""The endpoint check before a shard: dead server, wrong model, server still starting."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.preflight import EndpointUnavailable, ModelNotServed, check_endpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def serve_models(port: int, models: list[str]) -> web.AppRunner:
    async def listing(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in models]})

    app = web.Application()
    app.router.add_get("/v1/models", listing)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def test_unreachable_endpoint_is_one_clear_error():
    port = free_port()  # nothing listens here
    config = DriverConfig(endpoint=f"http://127.0.0.1:{port}")
    with pytest.raises(EndpointUnavailable, match=rf"cannot reach the inference endpoint http://127.0.0.1:{port}"):
        await check_endpoint(config, "m", wait_s=0)


async def test_model_not_served_names_what_is_served():
    port = free_port()
    runner = await serve_models(port, ["other-model"])
    try:
        with pytest.raises(ModelNotServed, match=r"'wanted' is not served .* serves \['other-model'\]"):
            await check_endpoint(DriverConfig(endpoint=f"http://127.0.0.1:{port}/v1"), "wanted")
        await check_endpoint(DriverConfig(endpoint=f"http://127.0.0.1:{port}"), "other-model")
    finally:
        await runner.cleanup()


async def test_waits_for_a_server_that_is_still_starting():
    port = free_port()
    config = DriverConfig(endpoint=f"http://127.0.0.1:{port}")
    started: list[web.AppRunner] = []

    async def start_later() -> None:
        await asyncio.sleep(1.5)
        started.append(await serve_models(port, ["m"]))

    starter = asyncio.create_task(start_later())
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await check_endpoint(config, "m", wait_s=20)
        assert loop.time() - t0 >= 1.4  # it really waited for the server
    finally:
        await starter
        for runner in started:
            await runner.cleanup()
