"""Online first inside a vLLM API server: a batch request never holds a slot an online one needs.

vLLM's ``--scheduling-policy priority`` admits waiting requests by priority and preempts the
lowest one for KV-cache space, but never for a sequence slot: a batch request already running
when an online burst arrives keeps its slot to the end of its generation, and the burst waits
for it. The batch driver's controller withdraws such requests, but only at its next look at
``/metrics`` (one tick, and a scrape of a busy server took ~1.1 s here), and that first tick is
where shared mode's burst tail came from (bench/RESULTS.md, ``bench/shared_capacity.py``).

This ASGI middleware (``--middleware aibrix_operators.serving.online_first.OnlineFirst``) makes
the decision where the request arrives, with the P/D router's rules (``router/admission.py``, the
same class): the server runs at most ``--max-num-seqs`` generation requests at once; when it is
full an online request waits ahead of every batch one and takes the newest running batch
request's slot at once. The app is told that request's client has gone, so vLLM aborts it as it
aborts any request whose client disconnects, and its slot is free for the next engine step; its
client gets ``429 batch_shed`` with ``Retry-After: 1``, which the driver waits out and sends
again, uncharged. Batch requests queued here are shed when an online one has to wait. Streamed
answers are never taken back (their headers are out).

A request is batch when its body's ``priority`` is above 0 (what the driver sends in shared
mode; online clients send none, which vLLM reads as 0). On a dedicated endpoint, where batch
requests carry no priority, every request is online and the middleware only queues requests
beyond ``--max-num-seqs`` here instead of in vLLM's own queue, in the same order.

Its gauges and counter are on the server's ``/metrics`` (prometheus_client's default registry,
which vLLM's ``/metrics`` serves in a single API-server process); the shared-mode controller
reads the online waiting count from there (capacity/signals.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from prometheus_client import Counter, Gauge

from aibrix_operators.router.admission import BATCH, ONLINE, Admission, Shed

# The requests that take one of the engine's sequence slots (vLLM's generation and pooling
# routes the batch pipeline sends to); everything else passes untouched.
GATED_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
    "/v1/score", "/v1/rerank", "/score", "/rerank", "/v2/rerank", "/pooling",
})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

INFLIGHT = Gauge("aibrix_online_first_inflight_requests",
                 "Generation requests the server runs, by class (online first)", ["class"])
WAITING = Gauge("aibrix_online_first_waiting_requests",
                "Requests waiting for a sequence slot at the server, by class (online first)", ["class"])
SHED = Counter("aibrix_online_first_shed_total",
               "Batch requests answered 429 batch_shed for online ones, by reason", ["reason"])

ABORT_GRACE_S = 1.0
RESERVE_ENV, QUIET_ENV = "AIBRIX_ONLINE_RESERVE", "AIBRIX_ONLINE_QUIET_S"
ALL_SLOTS = -1  # AIBRIX_ONLINE_RESERVE=all: every slot, whatever --max-num-seqs is

log = logging.getLogger(__name__)

SHED_BODY = {
    "preempted": "the server took this batch request back for an online one (preempted)",
    "online_waiting": "an online request is waiting for the server",
    "queue_full": "the server's batch queue is full",
    "waited_too_long": "the batch request waited too long for a slot",
}


def reserve_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """The online reserve (router/admission.py) from the server's environment: ``AIBRIX_ONLINE_RESERVE``
    (slots, or ``all``) and ``AIBRIX_ONLINE_QUIET_S``; unset: no reserve. vLLM's ``--middleware``
    takes a class, not arguments, so the deployment sets these on the server's container."""
    raw = env.get(RESERVE_ENV, "").strip().lower()
    quiet = env.get(QUIET_ENV, "").strip()
    settings: dict[str, Any] = {}
    try:
        if raw:
            settings["online_reserve"] = ALL_SLOTS if raw == "all" else int(raw)
            if settings["online_reserve"] < ALL_SLOTS:
                raise ValueError(raw)
        if quiet:
            settings["online_quiet_s"] = float(quiet)
            if not settings["online_quiet_s"] >= 0:
                raise ValueError(quiet)
    except ValueError:
        raise ValueError(f"{RESERVE_ENV}={raw!r} / {QUIET_ENV}={quiet!r}: the reserve is a number of "
                         "sequence slots or 'all', the quiet time seconds (0 or more)") from None
    return settings


def _max_num_seqs(scope: Scope) -> int:
    config = getattr(getattr(scope.get("app"), "state", None), "vllm_config", None)
    seqs = getattr(getattr(config, "scheduler_config", None), "max_num_seqs", None)
    if not isinstance(seqs, int) or seqs < 1:
        raise RuntimeError("OnlineFirst needs vLLM's app.state.vllm_config.scheduler_config.max_num_seqs")
    return seqs


def _body_fields(raw: bytes) -> dict[str, Any]:
    """The two fields the decision needs; an online body without ``priority`` is not parsed."""
    if b'"priority"' not in raw:
        return {}  # online: nothing else matters
    try:
        body = json.loads(raw)
    except ValueError:
        return {}  # vLLM answers it 400; it holds a slot only as long as that takes
    return body if isinstance(body, dict) else {}


async def _read_body(receive: Receive) -> tuple[list[Message], bytes]:
    messages, chunks = [], []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages, b"".join(chunks)
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return messages, b"".join(chunks)


def _replaying(messages: list[Message], receive: Receive, gone: asyncio.Event | None = None) -> Receive:
    """``receive`` for the app: the body already read, then the client's own messages, or an
    ``http.disconnect`` once ``gone`` is set (what vLLM's handlers listen for to abort)."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        if gone is None:
            return await receive()
        if gone.is_set():
            return {"type": "http.disconnect"}
        client = asyncio.ensure_future(receive())
        taken = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait((client, taken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Also when the app cancels this receive (vLLM stops listening for a disconnect once
            # its handler has answered): left pending, both tasks leaked until the garbage
            # collector destroyed them ("Task was destroyed but it is pending!" in the log).
            taken.cancel()
            if not client.done():
                client.cancel()
        if client.done() and not client.cancelled():
            return client.result()
        return {"type": "http.disconnect"}

    return replay


async def _send_shed(send: Send, reason: str) -> None:
    SHED.labels(reason).inc()
    message = f"{SHED_BODY.get(reason, reason)}; send it again after Retry-After"
    body = json.dumps({"error": {"message": message, "type": "rate_limit_error", "param": None,
                                 "code": "batch_shed"}}).encode()
    await send({"type": "http.response.start", "status": 429, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"), (b"x-aibrix-shed-reason", reason.encode()),
    ]})
    await send({"type": "http.response.body", "body": body})


class OnlineFirst:
    """The ASGI middleware; vLLM adds a class given to ``--middleware`` with ``app.add_middleware``."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self.admission: Admission | None = None
        # Read when vLLM builds its app: a bad value stops the server's start, not a request.
        self.reserve = reserve_settings(os.environ)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in GATED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.admission is None:
            # Built on the first request: the engine's config is on the app by then.
            seqs = _max_num_seqs(scope)
            reserve = dict(self.reserve)
            if reserve.get("online_reserve") == ALL_SLOTS:
                reserve["online_reserve"] = seqs
            self.admission = Admission(seqs, **reserve)
        admission = self.admission
        messages, raw = await _read_body(receive)
        body = _body_fields(raw)
        cls = admission.classify({}, body)
        WAITING.labels(cls).inc()
        try:
            await admission.admit(cls)
        except Shed as shed:
            await _send_shed(send, shed.reason)
            return
        finally:
            WAITING.labels(cls).dec()
        INFLIGHT.labels(cls).inc()
        try:
            if cls == BATCH and not body.get("stream"):
                await self._preemptible(admission, scope, messages, receive, send)
            else:
                await self.app(scope, _replaying(messages, receive), send)
        finally:
            INFLIGHT.labels(cls).dec()
            admission.release(cls)

    async def _preemptible(self, admission: Admission, scope: Scope, messages: list[Message],
                           receive: Receive, send: Send) -> None:
        """A batch request an online one may take back until its answer starts.

        Taking it back tells the app its client is gone: vLLM's handlers (``with_cancellation``)
        listen for that and cancel themselves, and ``AsyncLLM`` aborts the request, which frees
        its sequence slot. Cancelling the app's task instead would not: the handler runs in a
        task of its own that outlives a cancelled wrapper (tried: the generation ran to its end).
        """
        ticket = admission.preemption_ticket()
        gone = asyncio.Event()
        started = False

        async def send_unless_taken(message: Message) -> None:
            nonlocal started
            if gone.is_set():
                return  # what the app answers after being told its client left is not sent
            if message["type"] == "http.response.start":
                started = True
                admission.drop_ticket(ticket)  # from here on the answer is the client's
            await send(message)

        call = asyncio.ensure_future(self.app(scope, _replaying(messages, receive, gone), send_unless_taken))
        try:
            await asyncio.wait((call, ticket), return_when=asyncio.FIRST_COMPLETED)
            if call.done() or started:
                await call
                return
            gone.set()
            # The handler ends within an event-loop turn or two; one that does not listen for a
            # disconnect is cancelled after a grace period (its client gets its answer now).
            taken_at = time.monotonic()
            done, _ = await asyncio.wait((call,), timeout=ABORT_GRACE_S)
            if not done:
                log.warning("online first: a preempted batch request's handler did not end within %.1f s of "
                            "being told its client left; cancelled (%s)", ABORT_GRACE_S, scope.get("path"))
                call.cancel()
            elif time.monotonic() - taken_at > 0.1:
                log.info("online first: a preempted batch request took %.2f s to end",
                         time.monotonic() - taken_at)
            try:
                await call
            except asyncio.CancelledError:
                if not call.cancelled():
                    raise
            except Exception:  # noqa: BLE001 - the app's error after its client left: nobody to tell
                pass
        finally:
            admission.drop_ticket(ticket)
            if not call.done():
                call.cancel()
        await _send_shed(send, "preempted")


__all__ = ["BATCH", "GATED_PATHS", "ONLINE", "OnlineFirst"]
