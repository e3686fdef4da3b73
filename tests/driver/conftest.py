"""A real OpenAI-compatible HTTP server that injects faults, for driver tests.

It runs aiohttp.web on 127.0.0.1 (OS-assigned port) in its own thread and event
loop. Each request's body says how to misbehave: ``body["fault"]`` is a list of
actions, one per attempt (the last repeats), and ``body["cid"]`` names the
request so the server can count attempts per id. Actions:

    ok            200 chat completion with usage
    (a body with ``max_tokens: 1`` is the driver's health probe: answered ok, counted apart)
    slow:S        sleep S seconds, then ok
    hang:S        sleep S seconds (longer than the driver's timeout), then ok
    429           429 with an OpenAI error body, no Retry-After
    429ra:S       429 with ``Retry-After: S``
    500, 503      server errors with an OpenAI error body
    400           a non-retryable client error
    drop          close the socket before answering
    partial       send headers and half the body, then close the socket
    nonjson       200 with a body that is not JSON
    badusage      200 chat completion whose usage counts are not numbers

Any action can be delayed: ``503@0.05`` waits 50 ms, then answers 503.
``storm = 503`` makes every request fail with that status (a gateway with no healthy
upstream) until it is set back to None. ``down()`` takes the whole server off its
port (connections refused, open connections cut) and ``up()`` brings it back on the
same port: an endpoint restart.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from aiohttp import web


class FaultServer:
    def __init__(self) -> None:
        self.attempts: dict[str, list[float]] = defaultdict(list)  # cid -> arrival times
        self.lock = threading.Lock()
        self.inflight = 0
        self.canaries = 0  # health-probe replays, kept out of the per-id attempt counts
        self.storm: int | None = None  # set to 503 (say): every request gets that status
        self.max_inflight = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-server", daemon=True)
        self.port = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> FaultServer:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault server did not start")
        return self

    def stop(self) -> None:
        if self._runner is not None:
            fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
            fut.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def down(self) -> None:
        """Stop serving: the port refuses connections and open ones are cut."""
        runner, self._runner = self._runner, None
        if runner is not None:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(10)

    def up(self) -> None:
        """Serve again on the same port."""
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/v1/models", self._models)
        runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True, shutdown_timeout=0.5)
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        await web.SockSite(runner, sock).start()
        self._runner = runner

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._runner: web.AppRunner | None = None
        self._loop.run_until_complete(self._serve())
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ accounting
    def count(self, cid: str) -> int:
        with self.lock:
            return len(self.attempts.get(cid, []))

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {cid: len(ts) for cid, ts in self.attempts.items()}

    def times(self, cid: str) -> list[float]:
        with self.lock:
            return list(self.attempts.get(cid, []))

    # ------------------------------------------------------------------ handler
    async def _models(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.inflight += 1  # the handler runs on the server's single loop thread
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            return await self._answer(request)
        finally:
            self.inflight -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        cid = body.get("cid", "?")
        if self.storm is not None:  # the whole server fails, whatever the request
            return web.json_response(_error(None, "no healthy upstream", "server_error"), status=self.storm)
        if body.get("max_tokens") == 1:  # the driver's health probe replaying an answered request
            with self.lock:
                self.canaries += 1
            return web.json_response(_completion(cid, 0))
        with self.lock:
            self.attempts[cid].append(time.monotonic())
            attempt = len(self.attempts[cid])
        plan = body.get("fault") or ["ok"]
        action = plan[min(attempt, len(plan)) - 1]
        action, _, delay = action.partition("@")
        if delay:
            await asyncio.sleep(float(delay))
        name, _, arg = action.partition(":")
        if name in ("slow", "hang"):
            await asyncio.sleep(float(arg))
            name = "ok"
        if name == "ok":
            return web.json_response(_completion(cid, attempt),
                                     headers={"x-request-id": f"rq-{cid}-{attempt}"})
        if name in ("429", "429ra"):
            headers = {"x-request-id": f"rq-{cid}-{attempt}"}
            if name == "429ra":
                headers["Retry-After"] = arg
            return web.json_response(_error("rate_limit_exceeded", "slow down"), status=429, headers=headers)
        if name in ("500", "503"):
            return web.json_response(_error(None, f"server error {name}", "server_error"), status=int(name),
                                     headers={"x-request-id": f"rq-{cid}-{attempt}"})
        if name == "404model":  # vLLM when the adapter went between its model check and its lookup
            body = {"error": {"message": "The model `m` does not exist.", "type": "NotFoundError",
                              "param": None, "code": 404}}
            return web.json_response(body, status=404, headers={"x-request-id": f"rq-{cid}-{attempt}"})
        if name == "404route":  # a path the server does not serve (FastAPI's own 404)
            return web.json_response({"detail": "Not Found"}, status=404)
        if name == "400":
            return web.json_response(_error("invalid_value", "messages must not be empty"), status=400,
                                     headers={"x-request-id": f"rq-{cid}-{attempt}"})
        if name == "badusage":
            answer = _completion(cid, attempt)
            answer["usage"] = {"prompt_tokens": "n/a", "completion_tokens": None, "total_tokens": [1]}
            return web.json_response(answer, headers={"x-request-id": f"rq-{cid}-{attempt}"})
        if name == "nonjson":
            return web.Response(text="<html>proxy says hi</html>", content_type="text/html",
                                headers={"x-request-id": f"rq-{cid}-{attempt}"})
        if name == "drop":
            request.transport.close()
            raise asyncio.CancelledError()
        if name == "partial":
            payload = json.dumps(_completion(cid, attempt)).encode()
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            resp.content_length = len(payload)
            await resp.prepare(request)
            await resp.write(payload[: len(payload) // 2])
            request.transport.close()
            raise asyncio.CancelledError()
        raise AssertionError(f"unknown fault action {action!r}")


def _completion(cid: str, attempt: int) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{cid}-{attempt}", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": f"answer {cid}"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }


def _error(code: str | None, message: str, type_: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


@pytest.fixture
def fault_server() -> Iterator[FaultServer]:
    server = FaultServer().start()
    try:
        yield server
    finally:
        server.stop()


def request(cid: str, *fault: str) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                     "cid": cid, "fault": list(fault) or ["ok"]}}


@pytest.fixture
def make_request() -> Callable[..., dict[str, Any]]:
    """``make_request(cid, *actions)``: one batch input record for the fault server."""
    return request
