"""In-process routers (router/app.py) on 127.0.0.1 in front of StubBackends, for the router tests."""

from __future__ import annotations

from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from aibrix_operators.router.app import build_app
from aibrix_operators.router.backends import Backend
from tests.router.stub_backend import StubBackend


class RouterHarness:
    """Starts routers and remembers them, with their stubs, for close() to end."""

    def __init__(self) -> None:
        self.made: list[tuple[TestServer, aiohttp.ClientSession, list[StubBackend]]] = []

    async def serve(self, backends: list[Backend], stubs: list[StubBackend],
                    **build_kwargs: Any) -> tuple[TestServer, aiohttp.ClientSession]:  # fmt: skip
        # A long interval: the tests refresh the pool explicitly when they change a stub.
        server = TestServer(build_app(backends, health_interval_s=3600, **build_kwargs), host="127.0.0.1")
        await server.start_server()
        session = aiohttp.ClientSession()
        self.made.append((server, session, stubs))
        return server, session

    async def close(self) -> None:
        for server, session, stubs in self.made:
            await session.close()
            await server.close()
            for stub in stubs:
                await stub.close()
