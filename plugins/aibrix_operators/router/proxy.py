"""One client request: prefill (one token), then decode on the best decode instance.

Failure rules (ARCHITECTURE.md section 5: a request fails only for a reason of its own):
- prefill answers 4xx other than 408/429: the request itself is bad; that answer goes back
  to the client as it is.
- prefill unreachable, 408/429/5xx, or no healthy prefill instance: the request still goes
  to decode, which computes the prompt itself (the KV is content-addressed, so the output
  is the same; only the handoff is lost). Counted in ``router_prefill_fallback_total``.
- decode unreachable before any answer byte: the next healthy decode instance is tried.
- decode answers anything: status, headers and body go to the client unchanged (the batch
  driver decides what to retry). No healthy decode instance: 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from .adapters import RouterAdapters
from .admission import BATCH, Admission, Shed
from .affinity import PrefixAffinity, prefix_blocks
from .backends import DECODE, PREFILL, Backend, BackendPool
from .metrics import RouterMetrics
from .requests import decode_body, prefill_body

log = logging.getLogger(__name__)

_PASS_HEADERS = ("Content-Type", "x-request-id")
_RETRYABLE_4XX = (408, 429)


def openai_error(status: int, message: str, code: str, type_: str = "server_error") -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


@dataclass(eq=False)
class Proxy:
    pool: BackendPool
    session: aiohttp.ClientSession
    metrics: RouterMetrics
    _: KW_ONLY
    request_timeout_s: float = 600.0
    body_timeout_s: float = 30.0
    decode_attempts: int = 3
    affinity: PrefixAffinity | None = None
    admission: Admission | None = None
    adapters: RouterAdapters | None = None
    timeout: aiohttp.ClientTimeout = field(init=False)

    def __post_init__(self) -> None:
        self.timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)

    def _down(self, backend: Backend, reason: str) -> None:
        # Passive health: skip it from now on; the health loop brings it back.
        backend.healthy = False
        self.metrics.upstream_errors.labels(backend.role, reason).inc()
        self.metrics.observe_backend(backend)

    def _pick(
        self, role: str, blocks: list[int], prefer_pod_set: str | None = None, exclude: set[str] | None = None
    ) -> Backend | None:
        """Least-loaded, or with prefix affinity on, the instance holding the prompt's prefix
        (router/affinity.py)."""
        if not blocks or self.affinity is None:
            return self.pool.pick(role, prefer_pod_set, exclude)
        backend, outcome = self.affinity.pick(self.pool, role, blocks, prefer_pod_set, exclude)
        if outcome is not None:
            self.metrics.affinity_outcome(role, outcome).inc()
        return backend

    async def _prefill(
        self, path: str, body: dict[str, Any], blocks: list[int], exclude: set[str] | None = None
    ) -> tuple[web.Response | None, Backend | None, Any]:
        """Returns (a response to pass back to the client, the prefill instance, the
        kv_transfer_params it returned). The response is set only for the request's own error."""
        backend = self._pick(PREFILL, blocks, exclude=exclude)
        if backend is None:
            self.metrics.prefill_fallback.inc()
            return None, None, None
        t0 = time.perf_counter()
        backend.inflight += 1
        try:
            async with self.session.post(
                backend.url + path, data=orjson.dumps(prefill_body(body, path)),
                headers={"Content-Type": "application/json"}, timeout=self.timeout,
            ) as r:  # fmt: skip
                payload = await r.read()
                status = r.status
                ctype = r.headers.get("Content-Type", "application/json")
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            self._down(backend, type(exc).__name__)
            self.metrics.prefill_fallback.inc()
            return None, None, None
        finally:
            backend.inflight -= 1
            self.metrics.prefill_latency.observe(time.perf_counter() - t0)
        if status < 300:
            try:
                params = orjson.loads(payload).get("kv_transfer_params")
            except (orjson.JSONDecodeError, AttributeError):
                params = None
            return None, backend, params
        if 400 <= status < 500 and status not in _RETRYABLE_4XX:
            return web.Response(status=status, body=payload, headers={"Content-Type": ctype}), backend, None
        self.metrics.upstream_errors.labels(PREFILL, f"http_{status}").inc()
        self.metrics.prefill_fallback.inc()
        return None, None, None

    async def handle(self, request: web.Request, path: str) -> web.StreamResponse:
        try:
            # A body sent byte by byte would otherwise hold the connection for as long as the
            # sender likes (issue 19, finding 10); headers are bounded by the idle timeout.
            async with asyncio.timeout(self.body_timeout_s):
                raw = await request.read()
        except TimeoutError:
            error = openai_error(
                408, f"the request body did not arrive within {self.body_timeout_s:g} s; send it "
                "whole, or raise the router's --body-timeout-s", "request_timeout",
                "invalid_request_error",
            )  # fmt: skip
            error.force_close()  # then closed after aiohttp's short linger (router/cli.py)
            return error
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return openai_error(
                400, "request body is not valid JSON", "invalid_json", "invalid_request_error"
            )
        if not isinstance(body, dict):
            return openai_error(
                400, "request body must be a JSON object", "invalid_json", "invalid_request_error"
            )
        admission = self.admission
        if admission is None:
            return await self._route(path, request, raw, body)
        cls = admission.classify(request.headers, body)
        try:
            await admission.admit(cls)
        except Shed as shed:
            self.metrics.shed.labels(shed.reason).inc()
            error = openai_error(
                429, f"the router serves online requests first and has no room for this batch request now "
                f"({shed.reason}); send it again after Retry-After", "batch_shed", "rate_limit_error",
            )  # fmt: skip
            error.headers["Retry-After"] = "1"
            return error
        if cls == BATCH and not body.get("stream"):
            return await self._preemptible_route(admission, path, request, raw, body)
        try:
            return await self._route(path, request, raw, body)
        finally:
            admission.release(cls)

    async def _preemptible_route(
        self, admission: Admission, path: str, request: web.Request, raw: bytes, body: dict[str, Any]
    ) -> web.StreamResponse:
        """A forwarded batch request that an online one may take back: the upstream call is
        cancelled (vLLM aborts it) and the client gets 429 ``batch_shed``, which the driver waits
        out and sends again. Streamed answers are never taken back (their headers are out)."""
        ticket = admission.preemption_ticket()
        route = asyncio.ensure_future(self._route(path, request, raw, body))
        try:
            await asyncio.wait((route, ticket), return_when=asyncio.FIRST_COMPLETED)
            if route.done():
                return route.result()
            route.cancel()
            try:
                await route
            except asyncio.CancelledError:
                pass
        finally:
            admission.drop_ticket(ticket)
            if not route.done():
                route.cancel()
            admission.release(BATCH)
        self.metrics.shed.labels("preempted").inc()
        error = openai_error(
            429, "the router took this batch request back for an online one (preempted); send it again "
            "after Retry-After", "batch_shed", "rate_limit_error",
        )  # fmt: skip
        error.headers["Retry-After"] = "1"
        return error

    async def _route(
        self, path: str, request: web.Request, raw: bytes, body: dict[str, Any]
    ) -> web.StreamResponse:
        blocks = prefix_blocks(raw, body) if self.affinity is not None else []
        # A LoRA adapter loaded through the router: only instances that hold it may serve it.
        lacking = (self.adapters.lacking(body.get("model"), self.pool.backends)
                   if self.adapters is not None and self.adapters.wanted else None)
        error, prefill, params = await self._prefill(path, body, blocks, lacking)
        if error is not None:
            return error
        # The raw bytes when nothing changes (the common case, no re-encoding on the hot path).
        data = orjson.dumps(decode_body(body, params)) if params or "kv_transfer_params" in body else raw
        stream = bool(body.get("stream"))
        tried: set[str] = set(lacking or ())
        for _ in range(self.decode_attempts):
            backend = self._pick(DECODE, blocks, prefill.pod_set if prefill else None, tried)
            if backend is None:
                break
            if prefill is not None and prefill.pod_set and backend.pod_set == prefill.pod_set:
                self.metrics.pod_set_hits.inc()
            tried.add(backend.url)
            backend.inflight += 1
            try:
                return await self._decode(request, backend, path, data, stream)
            except _Unreachable as exc:
                self._down(backend, exc.reason)
                self.metrics.decode_retries.inc()
            finally:
                backend.inflight -= 1
        if lacking:
            return openai_error(503, "no healthy decode instance holds the LoRA adapter "
                                f"{body.get('model')!r} yet; send it again later", "no_decode_instance")
        return openai_error(503, "no healthy decode instance", "no_decode_instance")

    async def _decode(
        self, request: web.Request, backend: Backend, path: str, data: bytes, stream: bool
    ) -> web.StreamResponse:
        try:
            ctx = self.session.post(
                backend.url + path,
                data=data,
                headers={"Content-Type": "application/json"},
                timeout=self.timeout,
            )
            upstream = await ctx.__aenter__()
        except (aiohttp.ClientConnectionError, OSError) as exc:
            # Nothing was answered, so sending the request elsewhere cannot duplicate work
            # the client sees.
            raise _Unreachable(type(exc).__name__) from exc
        except TimeoutError:
            self.metrics.upstream_errors.labels(DECODE, "timeout").inc()
            return openai_error(504, "decode instance timed out", "upstream_timeout")
        out: web.StreamResponse | None = None
        try:
            headers = {k: upstream.headers[k] for k in _PASS_HEADERS if k in upstream.headers}
            if not stream or upstream.status >= 300:
                payload = await upstream.read()
                return web.Response(status=upstream.status, body=payload, headers=headers)
            out = web.StreamResponse(status=upstream.status, headers=headers)
            await out.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
            except (ConnectionResetError, asyncio.CancelledError):
                # The client went away mid-stream (aiohttp cancels the handler, or the write
                # fails): leaving closes the upstream call (finally below), so the decode
                # instance stops generating for nobody.
                self.metrics.upstream_errors.labels(DECODE, "client_gone").inc()
                raise
            return out
        except (TimeoutError, aiohttp.ClientError) as exc:
            # The answer broke off half way: the client sees a failed request (5xx or a cut
            # stream) and retries it; the instance may be fine, so it stays in the pool.
            self.metrics.upstream_errors.labels(DECODE, type(exc).__name__).inc()
            if out is not None:
                # Headers already went out: cutting the connection is the only honest signal.
                raise
            return openai_error(
                502, f"decode instance failed mid-answer: {type(exc).__name__}", "upstream_error"
            )
        finally:
            await ctx.__aexit__(None, None, None)


class _Unreachable(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
