"""Keep the pool current: health and load of every instance, and DNS discovery.

Every ``interval_s`` each instance gets ``GET /health`` and ``GET /metrics`` (load). A
failed request from the proxy marks an instance unhealthy at once (passive check); this
loop is what brings it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import KW_ONLY, dataclass, field

import aiohttp

from .adapters import RouterAdapters
from .backends import Backend, BackendPool
from .load import parse_load
from .metrics import RouterMetrics

log = logging.getLogger(__name__)


@dataclass(eq=False)
class HealthChecker:
    pool: BackendPool
    session: aiohttp.ClientSession
    metrics: RouterMetrics
    _: KW_ONLY
    interval_s: float = 1.0
    timeout_s: float = 2.0
    # role -> "host:port" of a headless Service whose A records are the instances.
    dns: dict[str, str] = field(default_factory=dict)
    scheme: str = "http"
    adapters: RouterAdapters | None = None
    timeout: aiohttp.ClientTimeout = field(init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.timeout = aiohttp.ClientTimeout(total=self.timeout_s)

    async def check(self, backend: Backend) -> None:
        was = backend.healthy
        try:
            async with self.session.get(backend.url + "/health", timeout=self.timeout) as r:
                await r.read()
                up = r.status == 200
            if up and not was and self.adapters is not None and self.adapters.wanted:
                # New or back (a restarted vLLM has lost adapters loaded at run time): it gets
                # the router's adapters before it counts as healthy. One it cannot load, it
                # does not serve (the proxy sends that adapter's requests elsewhere).
                outcome = await self.adapters.sync(backend)
                if not outcome.ok:
                    log.warning("LoRA adapters not synced to %s", outcome.detail)
            backend.healthy = up
            if backend.healthy:
                async with self.session.get(backend.url + "/metrics", timeout=self.timeout) as r:
                    if r.status == 200:
                        load = parse_load(await r.text())
                        backend.running, backend.waiting = load.running, load.waiting
                        backend.kv_usage = load.kv_usage
        except (TimeoutError, aiohttp.ClientError, OSError):
            backend.healthy = False
        if was != backend.healthy:
            log.info("%s %s is %s", backend.role, backend.url, "healthy" if backend.healthy else "down")
        self.metrics.observe_backend(backend)

    async def discover(self) -> None:
        loop = asyncio.get_running_loop()
        for role, target in self.dns.items():
            host, _, port = target.rpartition(":")
            try:
                infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except OSError as exc:
                # A lookup failure keeps the last known set: DNS blips must not empty the pool.
                log.warning("DNS discovery of %s (%s) failed: %s", role, target, exc)
                continue
            addrs = sorted({info[4][0] for info in infos})
            urls = [f"{self.scheme}://{a if ':' not in a else f'[{a}]'}:{port}" for a in addrs]
            self.pool.replace_discovered(role, urls)

    async def refresh(self) -> None:
        if self.dns:
            await self.discover()
        await asyncio.gather(*(self.check(b) for b in list(self.pool.backends)))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad round
                log.exception("health round failed")

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
