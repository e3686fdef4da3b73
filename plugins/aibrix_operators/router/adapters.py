"""LoRA adapters behind the router: loaded on every instance, and requests only where they are.

A batch's dispatch task loads its adapter with ``POST /v1/load_lora_adapter`` on the endpoint it
is given (docs/lora.md). Behind the router that endpoint is many instances of two roles, and
both need the adapter: prefill computes the prompt's KV with it, decode the tokens. So:

- **Load fans out.** The router loads the adapter (name and folder) on every healthy instance,
  asking each ``GET /v1/models`` first: an instance that already serves that folder is left
  alone. The answer is 200 only when every healthy instance holds it, and only then does the
  router remember it: a failed load changes no routing (the caller's retry loads it again).
  Who may load, and which names and folders, is the admin policy's (``admin.py``).
- **New and restarted instances catch up.** The health loop syncs the remembered adapters onto
  an instance before it counts as healthy again (a restarted vLLM has lost adapters loaded at
  run time).
- **Requests go only where the adapter is.** A request whose ``body.model`` is a remembered
  adapter is sent to instances holding it; with no such prefill instance, decode computes the
  prompt itself (as when prefill is down); with no such decode instance, 503.
- **``GET /v1/models``** lists an adapter only when the router loaded it and every healthy
  instance holds it, so the dispatch task's "already loaded?" check cannot skip a fan-out that
  is still needed (an adapter some instance got behind the router's back is not listed).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from .backends import Backend

log = logging.getLogger(__name__)


@dataclass
class LoadOutcome:
    ok: bool
    detail: str


@dataclass
class RouterAdapters:
    """The adapters loaded through this router: name -> the folder the instances load it from."""

    session: aiohttp.ClientSession
    timeout: aiohttp.ClientTimeout = field(default_factory=lambda: aiohttp.ClientTimeout(total=300))
    wanted: dict[str, str] = field(default_factory=dict)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def lacking(self, model: Any, backends: list[Backend]) -> set[str] | None:
        """URLs of instances that do not hold ``model``, or None when it is not a router adapter."""
        path = self.wanted.get(model) if isinstance(model, str) else None
        if path is None:
            return None
        return {b.url for b in backends if b.adapters.get(model) != path}

    async def _cards(self, backend: Backend) -> list[dict[str, Any]]:
        async with self.session.get(backend.url + "/v1/models", timeout=self.timeout) as r:
            if r.status != 200:
                raise aiohttp.ClientResponseError(r.request_info, (), status=r.status,
                                                  message="GET /v1/models")
            listing = orjson.loads(await r.read())
        cards = listing.get("data", []) if isinstance(listing, dict) else []
        return [c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)]

    async def base_models(self, backends: list[Backend]) -> set[str]:
        """The names the healthy instances serve as base models (cards without a ``parent``)."""
        names: set[str] = set()
        for backend in backends:
            if not backend.healthy:
                continue
            try:
                names |= {c["id"] for c in await self._cards(backend) if not c.get("parent")}
            except (TimeoutError, aiohttp.ClientError, OSError, orjson.JSONDecodeError):
                continue  # the load itself reports an instance that does not answer
        return names

    async def sync(self, backend: Backend, only: tuple[str, str] | None = None) -> LoadOutcome:
        """Load the remembered adapters the instance lacks, or just ``only`` (name, folder: a load
        not remembered yet); record what it holds."""
        lock = self._locks.setdefault(backend.url, asyncio.Lock())
        wanted = dict([only]) if only is not None else dict(self.wanted)
        async with lock:
            try:
                served = {c["id"]: str(c.get("root") or "") for c in await self._cards(backend)}
                backend.adapters = {n: p for n, p in served.items() if n in self.wanted or n in wanted}
                for name, path in wanted.items():
                    if served.get(name) == path:
                        continue
                    body = {"lora_name": name, "lora_path": path, "load_inplace": name in served}
                    async with self.session.post(backend.url + "/v1/load_lora_adapter",
                                                 data=orjson.dumps(body), timeout=self.timeout,
                                                 headers={"Content-Type": "application/json"}) as r:
                        text = (await r.read()).decode(errors="replace")[:300]
                        if r.status != 200:
                            return LoadOutcome(False, f"{backend.role} {backend.url}: HTTP {r.status} {text}")
                    backend.adapters[name] = path
                    log.info("LoRA adapter %s loaded on %s %s", name, backend.role, backend.url)
            except (TimeoutError, aiohttp.ClientError, OSError, orjson.JSONDecodeError) as exc:
                return LoadOutcome(False, f"{backend.role} {backend.url}: {type(exc).__name__}: {exc}")
        return LoadOutcome(True, f"{backend.role} {backend.url}")

    async def load(self, name: str, path: str, backends: list[Backend]) -> tuple[int, dict[str, Any]]:
        """The router's ``POST /v1/load_lora_adapter`` (already authorized and checked against the
        registry): load on every healthy instance, then remember. A failed load is not
        remembered, so it changes no routing and no instance gets it from the health loop."""
        healthy = [b for b in backends if b.healthy]
        if not healthy:
            return 503, _error("no healthy instance to load the adapter on", "no_instance")
        outcomes = await asyncio.gather(*(self.sync(b, only=(name, path)) for b in healthy))
        failed = [o.detail for o in outcomes if not o.ok]
        if failed:
            return 502, _error(f"LoRA adapter {name!r} did not load on {len(failed)} of {len(healthy)} "
                               f"instance(s): {'; '.join(failed)}", "lora_load_failed")
        self.wanted[name] = path
        return 200, {"loaded": name, "instances": len(healthy)}

    def filter_models(self, payload: bytes, backends: list[Backend]) -> bytes:
        """An instance's model list without the adapters the router cannot serve everywhere.

        An adapter card (vLLM gives it a ``parent``) stays only when this router loaded that
        adapter and every healthy instance holds it. One loaded on a single instance behind the
        router's back is not servable through it (the router does not route by it), and listing
        it would let a dispatch task's "already loaded?" check skip the load that fans it out."""
        try:
            listing = orjson.loads(payload)
            cards = listing["data"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return payload
        healthy = [b for b in backends if b.healthy]

        def servable(card: Any) -> bool:
            if not isinstance(card, dict) or not card.get("parent"):
                return True  # a base model
            return self.lacking(card.get("id"), healthy) == set()  # None: not loaded through us

        listing["data"] = [c for c in cards if servable(c)]
        return orjson.dumps(listing)


def _error(message: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
