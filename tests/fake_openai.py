"""The one fake OpenAI-compatible server of the tests and the benches.

Two ways to serve, one set of answers:

``RawStub`` (benches): raw asyncio HTTP/1.1 with keep-alive and pipelining, no framework and no
JSON parsing of requests (it frames them by ``Content-Length``), so a client measured against it
measures itself. Answers are bytes built once: ``POST /v1/chat/completions`` a ``chat.completion``
(and any POST to a path it does not know), ``POST /v1/completions`` a ``text_completion``,
``POST /v1/embeddings`` an embedding list, all with ``usage``; ``GET /health`` 200; ``GET /metrics``
vLLM's three load gauges at zero, or a page given to it (one captured from a real vLLM server); any
other GET a 404. With a delay (``--delay S``, 0 too) every POST is answered S seconds after it arrived, in
request order per connection, and ``GET /stats`` reports ``{"requests", "first_at", "last_at"}``
(wall-clock ``time.time()`` of the first and latest POST), which ``POST /reset`` zeroes. Run it as a
process::

    python tests/fake_openai.py --port 0 --cpu 1      # prints "PORT <n>" when listening
    python tests/fake_openai.py --count 4             # four stubs: "PORT <a> <b> <c> <d>"
    python tests/fake_openai.py --delay 1.0           # each POST answered after 1 s, arrivals kept
    python tests/fake_openai.py --ceiling PORT        # a trivial raw client: the stub's ceiling

``FakeOpenAI`` (tests, chaos trials): aiohttp on 127.0.0.1, in its own thread and loop
(``start()``/``stop()``) or in the running loop (``await astart()``/``await aclose()``; set ``port``
first to serve on a given one). It serves ``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings`` (and ``/v1/responses``, ``/v1/score``, ``/v1/rerank`` with a chat answer),
``/v1/models`` (``models``), ``/health`` and ``/metrics`` (vLLM's load gauges, settable, and
its token counters, ``served``), and
misbehaves as asked. A request's ``cid`` (the body's
``cid``, else ``custom_id`` in its ``metadata``) names it; attempts are counted per cid. The plan of
actions, one per attempt (the last repeats), is the body's ``fault`` list, else ``plans[cid]``,
else a seeded random pick (``chaos=seed``), else ``ok``. Actions:

    ok            200 answer with usage (deterministic: its text is ``answer <cid>``)
    (a body with ``max_tokens: 1`` is the driver's health probe: answered ok, counted apart)
    slow:S        sleep S seconds, then ok
    hang:S        sleep S seconds (longer than the client's timeout), then ok
    429           429 with an OpenAI error body, no Retry-After
    429ra:S       429 with ``Retry-After: S``
    500, 503      server errors with an OpenAI error body
    400           a non-retryable client error
    404model      vLLM's 404 for a model it does not (any longer) serve
    404route      a path the server does not serve (FastAPI's own 404 body)
    drop          close the socket before answering
    partial       send headers and half the body, then close the socket
    nonjson       200 with a body that is not JSON
    badusage      200 answer whose usage counts are not numbers

Any action can be delayed: ``503@0.05`` waits 50 ms, then answers 503. Server-wide: ``storm = 503``
answers every request (the listing too) with that status, a 429 storm with ``Retry-After: 0.2``,
until it is set back to None (a gateway with no healthy upstream); ``down()`` takes the server off
its port (connections refused, open ones cut) and ``up()`` brings it back on the same port (an
endpoint restart). It keeps ``attempts`` (cid -> arrival times, monotonic), ``answered`` (cid ->
wall-clock times of complete 200s), ``faults`` (fault name -> count), ``received`` (every POST's
path and body), ``canaries``, ``inflight`` and ``max_inflight``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from aiohttp import web

# ---------------------------------------------------------------------------------------- answers
# The answers, as dicts (FakeOpenAI) and as bytes built once (RawStub).


def chat_completion(
    content: str, id_: str = "chatcmpl-stub", model: str = "m", usage: tuple[int, int] = (5, 3)
) -> dict[str, Any]:
    return {
        "id": id_, "object": "chat.completion", "created": 0, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)},
    }  # fmt: skip


def text_completion(
    text: str, id_: str = "cmpl-stub", model: str = "m", usage: tuple[int, int] = (5, 3)
) -> dict[str, Any]:
    return {
        "id": id_, "object": "text_completion", "created": 0, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)},
    }  # fmt: skip


def embedding(seed: str, model: str = "m", dims: int = 8) -> dict[str, Any]:
    """A deterministic vector derived from ``seed`` (the request's cid)."""
    rng = random.Random(seed)
    vector = [round(rng.uniform(-1, 1), 6) for _ in range(dims)]
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": 0, "embedding": vector}],
            "usage": {"prompt_tokens": 5, "total_tokens": 5}}  # fmt: skip


def answer_for(path: str, cid: str, attempt: int, model: str = "m") -> dict[str, Any]:
    """The 200 answer to a POST to ``path``, derived from the request's cid and attempt."""
    if path.endswith("/embeddings"):
        return embedding(cid, model)
    if path.endswith("/chat/completions"):
        return chat_completion(f"answer {cid}", f"chatcmpl-{cid}-{attempt}", model)
    if path.endswith("/completions"):
        return text_completion(f"answer {cid}", f"cmpl-{cid}-{attempt}", model)
    return chat_completion(f"answer {cid}", f"chatcmpl-{cid}-{attempt}", model)


def error_body(code: str | int | None, message: str, type_: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def vllm_gauges(running: float = 0.0, waiting: float = 0.0, kv_usage: float = 0.0, model: str = "m") -> str:
    """vLLM's load gauges as its ``/metrics`` page names them."""
    labels = f'{{engine="0",model_name="{model}"}}'
    return (f"vllm:num_requests_running{labels} {float(running)}\n"
            f"vllm:num_requests_waiting{labels} {float(waiting)}\n"
            f"vllm:kv_cache_usage_perc{labels} {float(kv_usage)}\n")  # fmt: skip


def _compact(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def http_response(
    body: bytes, ctype: bytes = b"application/json", status: bytes = b"200 OK", extra: bytes = b""
) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body)  # fmt: skip


# The benches' answers: their bytes are what the benches were measured with.
CHAT_BODY = _compact(
    {
        "id": "chatcmpl-stub", "object": "chat.completion", "created": 1700000000, "model": "tiny-llama",
        "choices": [{"index": 0,
                     "message": {"role": "assistant", "content": "This is a stub answer of a few tokens."},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 120, "completion_tokens": 10, "total_tokens": 130},
    }
)  # fmt: skip
COMPLETION_BODY = _compact(
    {
        "id": "cmpl-stub", "object": "text_completion", "created": 1700000000, "model": "tiny-llama",
        "choices": [{"index": 0, "text": " a stub answer", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 120, "completion_tokens": 10, "total_tokens": 130},
    }
)  # fmt: skip
EMBEDDING_BODY = _compact(embedding("stub", "tiny-llama"))
CHAT = http_response(CHAT_BODY, extra=b"x-request-id: stub\r\n")
COMPLETION = http_response(COMPLETION_BODY)
EMBEDDINGS = http_response(EMBEDDING_BODY)
HEALTH = http_response(b"", b"text/plain")
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
METRICS_CTYPE = b"text/plain; version=0.0.4"
ZERO_GAUGES = vllm_gauges(model="tiny-llama").encode()


# --------------------------------------------------------------------------------------- RawStub
class Arrivals:
    """When POSTs arrived at a delayed stub (wall clock), so a bench can tell when the last new
    request was sent to it."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.requests = 0
        self.first_at: float | None = None
        self.last_at: float | None = None

    def record(self) -> None:
        now = time.time()
        self.requests += 1
        self.last_at = now
        if self.first_at is None:
            self.first_at = now

    def as_json(self) -> bytes:
        return json.dumps(
            {"requests": self.requests, "first_at": self.first_at, "last_at": self.last_at}
        ).encode()


class RawStub(asyncio.Protocol):
    """One connection of the raw stub; the class attributes are its answers (``configure``)."""

    __slots__ = ("transport", "buf", "next_send")
    POSTS: dict[bytes, bytes] = {b"/v1/completions": COMPLETION, b"/v1/embeddings": EMBEDDINGS}
    GETS: dict[bytes, bytes] = {b"/health": HEALTH, b"/metrics": http_response(ZERO_GAUGES, METRICS_CTYPE)}
    delayed = False  # with a delay (0 included), POSTs are answered late and their arrivals kept
    delay_s = 0.0
    arrivals = Arrivals()

    @classmethod
    def configure(cls, metrics_page: bytes | None = None, delay_s: float | None = None) -> None:
        if metrics_page is not None:
            cls.GETS = {**cls.GETS, b"/metrics": http_response(metrics_page, METRICS_CTYPE)}
        cls.delayed = delay_s is not None
        cls.delay_s = delay_s or 0.0
        cls.arrivals = Arrivals()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.buf = b""
        self.next_send = 0.0  # delayed answers leave in request order on a keep-alive connection

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        out = []
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = buf[:end]
            length = 0
            i = head.lower().find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                length = int(head[i + 17 : j if j >= 0 else len(head)])
            total = end + 4 + length
            if len(buf) < total:
                break
            buf = buf[total:]
            if head.startswith(b"POST /v1/chat/completions ") and not self.delayed:
                out.append(CHAT)  # the benches' hot path
                continue
            answer = self.answer(head)
            if answer:
                out.append(answer)
        self.buf = buf
        if out:
            self.transport.write(b"".join(out))  # type: ignore[attr-defined]

    def answer(self, head: bytes) -> bytes | None:
        path = head[head.find(b" ") + 1 : head.find(b" ", head.find(b" ") + 1)]
        if head.startswith(b"GET "):
            if path == b"/stats":
                return http_response(self.arrivals.as_json())
            return self.GETS.get(path, NOT_FOUND)
        if path == b"/reset":
            self.arrivals.reset()
            return http_response(b"{}")
        answer = self.POSTS.get(path, CHAT)
        if not self.delayed:
            return answer
        self.arrivals.record()
        loop = asyncio.get_running_loop()
        at = max(loop.time() + self.delay_s, self.next_send)
        self.next_send = at
        loop.call_at(at, self._send, answer)
        return None

    def _send(self, data: bytes) -> None:
        if not self.transport.is_closing():  # type: ignore[attr-defined]
            self.transport.write(data)  # type: ignore[attr-defined]


def pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        cpus = os.sched_getaffinity(0)
        if cpu in cpus or not cpus:
            os.sched_setaffinity(0, {cpu})


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def serve_raw(port: int = 0, count: int = 1, host: str = "127.0.0.1") -> None:
    """Serve ``count`` raw stubs (the first on ``port``) until killed; prints ``PORT <n>...``."""
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    servers = []
    for _ in range(count):
        servers.append(loop.run_until_complete(loop.create_server(RawStub, host, port, backlog=4096)))
    sys.stdout.write("PORT " + " ".join(str(s.sockets[0].getsockname()[1]) for s in servers) + "\n")
    sys.stdout.flush()
    try:
        loop.run_forever()
    finally:
        for server in servers:
            server.close()


async def _ceiling(port: int, requests: int, connections: int) -> float:
    """Requests/s of a minimal keep-alive client: one request in flight per connection."""
    payload = b'{"model":"tiny-llama","messages":[{"role":"user","content":"hi"}]}'
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)  # fmt: skip
    resp_len = len(CHAT)
    left = [requests]

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while left[0] > 0:
            left[0] -= 1
            writer.write(req)
            await reader.readexactly(resp_len)
        writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(connections)))
    return requests / (time.perf_counter() - t0)


def ceiling(port: int, requests: int = 20_000, connections: int = 64) -> float:
    loop = _new_loop()
    try:
        return loop.run_until_complete(_ceiling(port, requests, connections))
    finally:
        loop.close()


# ------------------------------------------------------------------------------------ FakeOpenAI
# Per-attempt fault mix of the chaos trials. Kept low enough that a request's 5 attempts all failing
# is a ~1e-7 event; sustained failure is what the storms and outages are for.
CHAOS_FAULTS = (("drop", 0.015), ("partial", 0.015), ("nonjson", 0.01), ("503", 0.01),
                ("429", 0.02), ("429ra", 0.01), ("slow", 0.05))  # fmt: skip
CHAOS_ACTIONS = {"429ra": "429ra:0.1"}
# What FakeOpenAI serves a POST on: vLLM's batch endpoints (the last three answered as a chat).
POST_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/score",
              "/v1/rerank")  # fmt: skip


class FakeOpenAI:
    def __init__(
        self,
        model: str = "m",
        chaos: int | None = None,
        plans: dict[str, list[str]] | None = None,
        models: Iterable[str] | None = None,
    ) -> None:
        self.model = model
        self.models = list(models) if models is not None else [model]
        self.plans: dict[str, list[str]] = dict(plans or {})
        self.rng = random.Random(chaos) if chaos is not None else None
        self.attempts: dict[str, list[float]] = defaultdict(list)  # cid -> arrival times (monotonic)
        self.answered: dict[str, list[float]] = defaultdict(list)  # cid -> times of complete 200s (wall)
        self.faults: dict[str, int] = defaultdict(int)
        self.received: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()
        self.inflight = 0
        self.max_inflight = 0
        self.canaries = 0  # health-probe replays, kept out of the per-id attempt counts
        self.storm: int | None = None  # set to 503 (say): every request gets that status
        self.healthy = True
        self.gauges = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
        # vLLM's token counters: what every answer with usage served (prompt, generation).
        self.served = [0, 0]
        # OpenAI's Files and Batches API, answered with this fake's answers. Imported here: run as
        # a script (the RawStub), tests/ is not a package on the path.
        from tests.fake_openai_batches import BatchService

        self.batches = BatchService(model=model)
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> FakeOpenAI:
        """Serve from a thread of its own (for tests and benches that block)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-openai", daemon=True)
        self._thread.start()
        self.up()
        return self

    def __enter__(self) -> FakeOpenAI:
        """``with FakeOpenAI(...).start() as server:`` stops it at the block's end."""
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        assert self._loop is not None and self._thread is not None
        self.down()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def down(self) -> None:
        """Stop serving: the port refuses connections and open ones are cut."""
        assert self._loop is not None
        runner, self._runner = self._runner, None
        if runner is not None:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(10)

    def up(self) -> None:
        """Serve again on the same port."""
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)

    async def astart(self) -> FakeOpenAI:
        """Serve in the running loop (for async tests)."""
        await self._serve()
        return self

    async def aclose(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    def app(self) -> web.Application:
        app = web.Application()
        for path in POST_PATHS:
            app.router.add_post(path, self._handle)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self.batches.add_routes(app)
        return app

    async def _serve(self) -> None:
        runner = web.AppRunner(
            self.app(), handle_signals=False, handler_cancellation=True, shutdown_timeout=0.2
        )
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        await web.SockSite(runner, sock).start()
        self._runner = runner

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

    # ------------------------------------------------------------------ handlers
    def _storm(self) -> web.Response:
        assert self.storm is not None
        headers = {"Retry-After": "0.2"} if self.storm == 429 else None
        return web.json_response(
            error_body(None, "no healthy upstream", "server_error"), status=self.storm, headers=headers
        )

    async def _models(self, request: web.Request) -> web.StreamResponse:
        if self.storm is not None:
            return self._storm()
        return web.json_response(
            {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}
        )

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200 if self.healthy and self.storm is None else 503)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        labels = f'{{model_name="{self.model}"}}'
        counters = (f"vllm:prompt_tokens_total{labels} {float(self.served[0])}\n"
                    f"vllm:generation_tokens_total{labels} {float(self.served[1])}\n")
        return web.Response(text=vllm_gauges(**self.gauges, model=self.model) + counters,
                            content_type="text/plain")

    def _count_served(self, answer: dict[str, Any]) -> dict[str, Any]:
        """Count an answer's tokens as vLLM's counters do."""
        usage = answer.get("usage") or {}
        with self.lock:
            self.served[0] += int(usage.get("prompt_tokens") or 0)
            self.served[1] += int(usage.get("completion_tokens") or 0)
        return answer

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.inflight += 1  # the handler runs on the server's single loop thread
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            return await self._answer(request)
        finally:
            self.inflight -= 1

    def _action(self, body: dict[str, Any], cid: str, attempt: int) -> str:
        plan = body.get("fault") or self.plans.get(cid)
        if plan:
            return plan[min(attempt, len(plan)) - 1]
        if self.rng is None:
            return "ok"
        x, name = self.rng.random(), "ok"
        for fault, p in CHAOS_FAULTS:
            if x < p:
                name = fault
                break
            x -= p
        if name == "slow":
            return f"ok@{self.rng.uniform(0.1, 0.3)}"
        return f"{CHAOS_ACTIONS.get(name, name)}@{self.rng.uniform(0, 0.01)}"

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        cid = str(body.get("cid") or (body.get("metadata") or {}).get("custom_id") or "?")
        model = str(body.get("model") or self.model)  # answered as asked, as a real server does
        self.received.append((request.path, body))
        if self.storm is not None:  # the whole server fails, whatever the request
            return self._storm()
        if body.get("max_tokens") == 1:  # the driver's health probe replaying an answered request
            with self.lock:
                self.canaries += 1
            return web.json_response(self._count_served(answer_for(request.path, cid, 0, model)))
        with self.lock:
            self.attempts[cid].append(time.monotonic())
            attempt = len(self.attempts[cid])
        action, _, delay = self._action(body, cid, attempt).partition("@")
        if delay:
            await asyncio.sleep(float(delay))
        name, _, arg = action.partition(":")
        if name not in ("ok", "slow", "hang"):
            with self.lock:
                self.faults[name] += 1
        if name in ("slow", "hang"):
            await asyncio.sleep(float(arg))
            name = "ok"
        rid = {"x-request-id": f"rq-{cid}-{attempt}"}
        if name == "ok":
            answer = self._count_served(answer_for(request.path, cid, attempt, model))
            response = web.json_response(answer, headers=rid)
            await response.prepare(request)
            await response.write_eof()
            with self.lock:
                self.answered[cid].append(time.time())  # wall clock: compared with file mtimes
            return response
        if name in ("429", "429ra"):
            headers = {**rid, "Retry-After": arg} if name == "429ra" else rid
            return web.json_response(
                error_body("rate_limit_exceeded", "slow down"), status=429, headers=headers
            )
        if name in ("500", "503"):
            return web.json_response(
                error_body(None, f"server error {name}", "server_error"), status=int(name), headers=rid
            )
        if name == "404model":  # vLLM when the adapter went between its model check and its lookup
            answer = {
                "error": {
                    "message": f"The model `{model}` does not exist.",
                    "type": "NotFoundError",
                    "param": None,
                    "code": 404,
                }
            }
            return web.json_response(answer, status=404, headers=rid)
        if name == "404route":  # a path the server does not serve (FastAPI's own 404)
            return web.json_response({"detail": "Not Found"}, status=404)
        if name == "400":
            return web.json_response(
                error_body("invalid_value", "messages must not be empty"), status=400, headers=rid
            )
        if name == "badusage":
            answer = answer_for(request.path, cid, attempt, model)
            answer["usage"] = {"prompt_tokens": "n/a", "completion_tokens": None, "total_tokens": [1]}
            return web.json_response(answer, headers=rid)
        if name == "nonjson":
            return web.Response(text="<html>proxy says hi</html>", content_type="text/html", headers=rid)
        if name == "drop":
            assert request.transport is not None
            request.transport.close()
            raise asyncio.CancelledError()
        if name == "partial":
            payload = json.dumps(answer_for(request.path, cid, attempt, model)).encode()
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            resp.content_length = len(payload)
            await resp.prepare(request)
            await resp.write(payload[: len(payload) // 2])
            assert request.transport is not None
            request.transport.close()
            raise asyncio.CancelledError()
        raise AssertionError(f"unknown fault action {action!r}")


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--count", type=int, default=1, help="listen on this many ports (one stub each)")
    p.add_argument("--cpu", type=int, default=None, help="pin the server to this CPU")
    p.add_argument("--delay", type=float, default=None,
                   help="seconds before each POST's answer; arrivals are kept (GET /stats)")  # fmt: skip
    p.add_argument("--metrics-page", default=None, help="answer GET /metrics with this file")
    p.add_argument("--ceiling", type=int, default=None, metavar="PORT",
                   help="instead of serving, measure a stub on PORT with a trivial client")  # fmt: skip
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--connections", type=int, default=64)
    args = p.parse_args(argv)
    pin(args.cpu)
    if args.ceiling is not None:
        print(f"{ceiling(args.ceiling, args.requests, args.connections):.1f}")
        return 0
    page = None
    if args.metrics_page:
        with open(args.metrics_page, "rb") as fh:
            page = fh.read()
    RawStub.configure(page, args.delay)
    serve_raw(args.port, args.count)
    return 0


if __name__ == "__main__":
    sys.exit(main())
