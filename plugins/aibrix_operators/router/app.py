"""The router's aiohttp application: routes, startup and shutdown."""

from __future__ import annotations

from time import perf_counter

import aiohttp
import orjson
from aiohttp import web

from .adapters import RouterAdapters
from .admin import TOKEN_HEADER, AdminPolicy
from .admission import Admission
from .affinity import DEFAULT_ENTRIES, DEFAULT_SLACK, PrefixAffinity
from .backends import DECODE, PREFILL, Backend, BackendPool
from .health import HealthChecker
from .metrics import RouterMetrics
from .proxy import Proxy, openai_error
from .requests import CHAT, COMPLETIONS

POLICY_HEADER = "x-aibrix-scheduling-policy"  # what serving/scheduling_policy.py reports for vLLM

POOL = web.AppKey("pool", BackendPool)
METRICS = web.AppKey("metrics", RouterMetrics)
PROXY = web.AppKey("proxy", Proxy)
CHECKER = web.AppKey("checker", HealthChecker)
SESSION = web.AppKey("session", aiohttp.ClientSession)
ADAPTERS = web.AppKey("adapters", RouterAdapters)


def build_app(
    backends: list[Backend],
    *,
    health_interval_s: float = 1.0,
    request_timeout_s: float = 600.0,
    body_timeout_s: float = 30.0,
    dns: dict[str, str] | None = None,
    prefix_affinity: bool = True,
    affinity_entries: int = DEFAULT_ENTRIES,
    affinity_slack: float = DEFAULT_SLACK,
    admission: Admission | None = None,
    admin: AdminPolicy | None = None,
) -> web.Application:
    admin = admin or AdminPolicy()  # no token: the admin routes are off
    app = web.Application(client_max_size=64 << 20)
    pool = BackendPool(backends)
    metrics = RouterMetrics()
    affinity = PrefixAffinity(affinity_entries, affinity_slack) if prefix_affinity else None
    app[POOL] = pool
    app[METRICS] = metrics
    if admission is not None:
        metrics.watch_admission(admission)

    async def startup(app: web.Application) -> None:
        # No connection cap: the batch driver bounds concurrency; keep-alive connections
        # are reused across requests (the router's overhead is mostly connection work).
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60), json_serialize=orjson.dumps,
            auto_decompress=False,
        )  # fmt: skip
        app[SESSION] = session
        adapters = RouterAdapters(session)
        app[ADAPTERS] = adapters
        app[PROXY] = Proxy(pool, session, metrics, request_timeout_s=request_timeout_s,
                             body_timeout_s=body_timeout_s, affinity=affinity,
                             admission=admission, adapters=adapters)  # fmt: skip
        checker = HealthChecker(pool, session, metrics, interval_s=health_interval_s, dns=dict(dns or {}),
                                adapters=adapters)
        app[CHECKER] = checker
        await checker.refresh()  # serve with a known pool from the first request
        checker.start()

    async def cleanup(app: web.Application) -> None:
        await app[CHECKER].stop()
        await app[SESSION].close()

    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)

    def route(path: str):  # type: ignore[no-untyped-def]
        endpoint = path.rsplit("/", 1)[-1]
        requests = {s: metrics.requests.labels(endpoint, str(s)) for s in (200, 400, 500, 503)}
        latency = metrics.latency.labels(endpoint)

        async def handler(request: web.Request) -> web.StreamResponse:
            t0 = perf_counter()
            metrics.inflight.inc()
            try:
                resp = await app[PROXY].handle(request, path)
            finally:
                metrics.inflight.dec()
            counter = requests.get(resp.status) or metrics.requests.labels(endpoint, str(resp.status))
            counter.inc()
            latency.observe(perf_counter() - t0)
            return resp

        return handler

    async def models(request: web.Request) -> web.StreamResponse:
        for role in (DECODE, PREFILL):
            backend = pool.pick(role)
            if backend is None:
                continue
            try:
                async with app[SESSION].get(
                    backend.url + "/v1/models", timeout=aiohttp.ClientTimeout(10)
                ) as r:
                    payload = await r.read()
                    if r.status == 200:
                        payload = app[ADAPTERS].filter_models(payload, pool.backends)
                    resp = web.Response(status=r.status, body=payload, content_type="application/json")
                    # "priority" only when both hold: the router forwards online requests first and
                    # the instance schedules by priority too (a batch request already forwarded
                    # must still yield inside vLLM).
                    backend_policy = r.headers.get(POLICY_HEADER)
                    if backend_policy is not None:
                        ours = backend_policy if admission is not None else "router-fcfs"
                        resp.headers[POLICY_HEADER] = ours
                    return resp
            except (aiohttp.ClientError, TimeoutError, OSError):
                continue
        return openai_error(503, "no healthy instance", "no_instance")

    async def load_lora_adapter(request: web.Request) -> web.StreamResponse:
        # Authorized before a byte of the body is read.
        refusal = admin.authorize(request.headers.get(TOKEN_HEADER))
        if refusal is not None:
            return openai_error(refusal.status, refusal.message, refusal.code, "invalid_request_error")
        try:
            body = orjson.loads(await request.read())
            name, path = body["lora_name"], body["lora_path"]
            if not (isinstance(name, str) and name and isinstance(path, str) and path):
                raise TypeError
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return openai_error(400, "send {\"lora_name\": ..., \"lora_path\": ...}", "invalid_request",
                                "invalid_request_error")
        refusal = admin.folder_of(name, path, await app[ADAPTERS].base_models(pool.backends))
        if refusal is not None:
            return openai_error(refusal.status, refusal.message, refusal.code, "invalid_request_error")
        status, answer = await app[ADAPTERS].load(name, path, pool.backends)
        return web.Response(status=status, body=orjson.dumps(answer), content_type="application/json")

    async def health(request: web.Request) -> web.StreamResponse:
        # Decode is what must be up: without prefill, decode computes prompts itself.
        body = {
            role: {"healthy": len(pool.healthy(role)), "total": len(pool.role(role))}
            for role in (PREFILL, DECODE)
        }
        status = 200 if body[DECODE]["healthy"] else 503
        return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")

    async def prometheus(request: web.Request) -> web.StreamResponse:
        return web.Response(body=metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    app.router.add_post(CHAT, route(CHAT))
    app.router.add_post(COMPLETIONS, route(COMPLETIONS))
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", prometheus)
    return app
