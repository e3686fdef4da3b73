"""A scriptable vLLM stand-in on a real aiohttp server: health, load gauges, answers."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer


@dataclass
class StubBackend:
    name: str
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    healthy: bool = True
    # (status, body) for POSTs; None = a normal completion.
    answer: tuple[int, dict[str, Any]] | None = None
    # Extra fields in a 200 answer (e.g. kv_transfer_params from a prefill).
    extra: dict[str, Any] = field(default_factory=dict)
    # SSE chunks to send when the request asks to stream, with a pause between them.
    stream_chunks: list[str] = field(default_factory=lambda: ["a", "b", "c"])
    stream_pause_s: float = 0.0
    received: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    delay_s: float = 0.0  # each POST is answered after this long (a busy instance)
    # The x-aibrix-scheduling-policy header on /v1/models (serving/scheduling_policy.py); None: none.
    policy: str | None = None
    # Stream chunks written so far (all requests).
    chunks_sent: int = 0
    server: TestServer | None = None
    # LoRA adapters this instance serves (name -> folder), and the load calls it got.
    loras: dict[str, str] = field(default_factory=dict)
    lora_loads: list[dict[str, Any]] = field(default_factory=list)
    # (status, text) for POST /v1/load_lora_adapter; None = load it.
    lora_answer: tuple[int, str] | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._post)
        app.router.add_post("/v1/chat/completions", self._post)
        app.router.add_post("/v1/load_lora_adapter", self._load_lora)
        return app

    async def _load_lora(self, request: web.Request) -> web.Response:
        # vLLM's rules: a name already loaded needs load_inplace.
        body = await request.json()
        self.lora_loads.append(body)
        if self.lora_answer is not None:
            return web.Response(status=self.lora_answer[0], text=self.lora_answer[1])
        if body["lora_name"] in self.loras and not body.get("load_inplace"):
            return web.json_response({"error": {"message": "has already been loaded"}}, status=400)
        self.loras[body["lora_name"]] = body["lora_path"]
        return web.Response(text="Success")

    async def start(self) -> StubBackend:
        self.server = TestServer(self.app(), host="127.0.0.1")
        await self.server.start_server()
        return self

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        labels = '{engine="0",model_name="m"}'
        text = (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{labels} {self.running}\n"
            f"vllm:num_requests_waiting{labels} {self.waiting}\n"
            f"vllm:kv_cache_usage_perc{labels} {self.kv_usage}\n"
            f'vllm:num_requests_waiting_by_reason{{engine="0",reason="capacity"}} 99.0\n'
        )
        return web.Response(text=text)

    async def _models(self, request: web.Request) -> web.Response:
        headers = {"x-aibrix-scheduling-policy": self.policy} if self.policy else None
        cards = [{"id": "m", "object": "model", "root": "/models/m"}]
        cards += [{"id": n, "object": "model", "root": p, "parent": "m"} for n, p in self.loras.items()]
        listing = {"object": "list", "data": cards}
        return web.json_response(listing, headers=headers)

    async def _post(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append((request.path, body))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.answer is not None:
            status, payload = self.answer
            return web.json_response(payload, status=status)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for chunk in self.stream_chunks:
                data = {"choices": [{"index": 0, "text": chunk}], "from": self.name}
                await resp.write(f"data: {json.dumps(data)}\n\n".encode())
                self.chunks_sent += 1
                await asyncio.sleep(self.stream_pause_s)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response(
            {"object": "text_completion", "from": self.name, "choices": [{"index": 0, "text": "x"}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 1}, **self.extra},
            headers={"x-request-id": f"req-{self.name}"},
        )  # fmt: skip
