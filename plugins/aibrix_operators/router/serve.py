"""Serve the router's app with a cap on open connections.

aiohttp bounds how long a connection may sit without a whole request (``keepalive_timeout``),
not how many there are: without a cap one client can hold ``rate x timeout`` sockets, up to the
pod's file-descriptor limit, and starve everyone else. So the listening socket is created here,
with aiohttp's own request handler behind a factory that counts its open connections (the
``web.Server``'s public ``connections``); past the cap a new connection is answered
``503`` with ``Retry-After`` and closed at once (the batch driver retries a 503 as an outage,
never as a failed request). Everything else is ``web.run_app``'s: the app's startup and cleanup,
SIGTERM's graceful shutdown with its timeout, the loop's teardown.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web

_BODY = b'{"error": {"code": "too_many_connections", "message": "the router is at its --max-connections"}}'
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
           b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY))


class _Refused(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an isinstance check: uvloop's transports are not asyncio.Transport subclasses.
        cast(asyncio.Transport, transport).write(REFUSAL)
        transport.close()


class CappedServer:
    """A protocol factory: aiohttp's handler while fewer than ``cap`` connections are open."""

    def __init__(self, server: web.Server, cap: int) -> None:
        self.server = server
        self.cap = cap
        self.refused = 0

    def __call__(self) -> asyncio.Protocol:
        if len(self.server.connections) >= self.cap:
            self.refused += 1
            return _Refused()
        return self.server()


async def _serve(app: web.Application, host: str, port: int, cap: int, backlog: int,
                 announce: Callable[[str], None], runner_kwargs: dict[str, Any]) -> None:
    runner = web.AppRunner(app, **runner_kwargs)
    await runner.setup()
    listener: asyncio.base_events.Server | None = None
    try:
        assert runner.server is not None
        loop = asyncio.get_running_loop()
        listener = await loop.create_server(CappedServer(runner.server, cap), host, port, backlog=backlog,
                                            reuse_address=True, family=socket.AF_UNSPEC)
        bound = ", ".join(f"http://{s.getsockname()[0]}:{s.getsockname()[1]}" for s in listener.sockets)
        announce(f"======== Running on {bound} (at most {cap} connections) ========")
        while True:
            await asyncio.sleep(3600)
    finally:
        if listener is not None:
            listener.close()  # stop accepting first; requests in flight get the shutdown timeout
        await runner.cleanup()


def run(app: web.Application, *, host: str, port: int, max_connections: int,
        announce: Callable[[str], None], loop: asyncio.AbstractEventLoop | None = None,
        backlog: int = 128, **runner_kwargs: Any) -> None:
    """Like ``web.run_app(app, host=…, port=…, **runner_kwargs)``, with the connection cap."""
    loop = loop or asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    task = loop.create_task(_serve(app, host, port, max_connections, backlog, announce, runner_kwargs))
    try:
        loop.run_until_complete(task)
    except (web.GracefulExit, KeyboardInterrupt):  # SIGTERM / SIGINT (handle_signals=True)
        pass
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, web.GracefulExit):
            loop.run_until_complete(task)
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
