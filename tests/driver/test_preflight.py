"""The endpoint check before a shard: dead server, wrong model, server still starting."""

from __future__ import annotations

import asyncio

import pytest

from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.preflight import EndpointUnavailable, ModelNotServed, check_endpoint
from aibrix_operators.serving.local_vllm import free_port
from tests.fake_openai import FakeOpenAI


async def serve_models(port: int, models: list[str]) -> FakeOpenAI:
    server = FakeOpenAI(models=models)
    server.port = port
    return await server.astart()


async def test_unreachable_endpoint_is_one_clear_error():
    port = free_port()  # nothing listens here
    config = DriverConfig(endpoint=f"http://127.0.0.1:{port}")
    with pytest.raises(
        EndpointUnavailable, match=rf"cannot reach the inference endpoint http://127.0.0.1:{port}"
    ):
        await check_endpoint(config, "m", wait_s=0)


async def test_model_not_served_names_what_is_served():
    port = free_port()
    server = await serve_models(port, ["other-model"])
    try:
        with pytest.raises(ModelNotServed, match=r"'wanted' is not served .* serves \['other-model'\]"):
            await check_endpoint(DriverConfig(endpoint=f"http://127.0.0.1:{port}/v1"), "wanted")
        await check_endpoint(DriverConfig(endpoint=f"http://127.0.0.1:{port}"), "other-model")
    finally:
        await server.aclose()


async def test_waits_for_a_server_that_is_still_starting():
    port = free_port()
    config = DriverConfig(endpoint=f"http://127.0.0.1:{port}")
    started: list[FakeOpenAI] = []

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
        for server in started:
            await server.aclose()
