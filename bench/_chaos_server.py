"""An OpenAI-compatible chat server that misbehaves at random, for the chaos trials.

Per request (seeded): a latency, and now and then a fault — a dropped connection,
half a body, a 200 that is not JSON, a 503, a 429 with or without Retry-After.
Server-wide, the trial controller can take it off its port (``down``/``up``: an
endpoint restart) or answer every request with one status (``storm``). It
records which ``custom_id``s it answered with a complete 200 and when, so a
trial can tell re-sent work from faults.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from collections import defaultdict
from typing import Any

from aiohttp import web

# Per-attempt fault mix. Kept low enough that a request's 5 attempts all failing is a
# ~1e-7 event; sustained failure is what the storms and outages are for.
FAULTS = (("drop", 0.015), ("partial", 0.015), ("nonjson", 0.01), ("503", 0.01),
          ("429", 0.02), ("429ra", 0.01), ("slow", 0.05))


class ChaosServer:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.answered: dict[str, list[float]] = defaultdict(list)  # cid -> times of complete 200s
        self.faults: dict[str, int] = defaultdict(int)
        self.canaries = 0
        self.storm: int | None = None
        self.lock = threading.Lock()
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self) -> ChaosServer:
        self._thread.start()
        self.up()
        return self

    def stop(self) -> None:
        self.down()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def down(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(10)

    def up(self) -> None:
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/v1/models", self._models)
        runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True, shutdown_timeout=0.2)
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        await web.SockSite(runner, sock).start()
        self._runner = runner

    async def _models(self, request: web.Request) -> web.StreamResponse:
        if self.storm is not None:
            return web.json_response({"error": {"message": "storm"}}, status=self.storm)
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    def _pick(self) -> str:
        x = self.rng.random()
        for name, p in FAULTS:
            if x < p:
                return name
            x -= p
        return "ok"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        cid = body.get("cid", "?")
        if self.storm is not None:
            headers = {"Retry-After": "0.2"} if self.storm == 429 else {}
            return web.json_response({"error": {"message": "storm", "type": "server_error"}},
                                     status=self.storm, headers=headers)
        if body.get("max_tokens") == 1:  # the driver's health probe
            with self.lock:
                self.canaries += 1
            return web.json_response(_completion(cid))
        action = self._pick()
        await asyncio.sleep(self.rng.uniform(0.1, 0.3) if action == "slow" else self.rng.uniform(0, 0.01))
        if action not in ("ok", "slow"):
            with self.lock:
                self.faults[action] += 1
        if action == "drop":
            request.transport.close()
            raise asyncio.CancelledError()
        if action == "partial":
            payload = json.dumps(_completion(cid)).encode()
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            resp.content_length = len(payload)
            await resp.prepare(request)
            await resp.write(payload[: len(payload) // 2])
            request.transport.close()
            raise asyncio.CancelledError()
        if action == "nonjson":
            return web.Response(text="<html>502 upstream</html>", content_type="text/html")
        if action == "503":
            return web.json_response({"error": {"message": "overloaded", "type": "server_error"}}, status=503)
        if action in ("429", "429ra"):
            headers = {"Retry-After": "0.1"} if action == "429ra" else {}
            return web.json_response({"error": {"message": "slow down", "code": "rate_limit_exceeded"}},
                                     status=429, headers=headers)
        response = web.json_response(_completion(cid))
        await response.prepare(request)
        await response.write_eof()
        with self.lock:
            self.answered[cid].append(time.time())  # wall clock: compared with file mtimes
        return response


def _completion(cid: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{cid}", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": f"answer {cid}"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }
