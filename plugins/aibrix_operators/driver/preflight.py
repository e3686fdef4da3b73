"""Check the endpoint before sending a shard, so a dead server or a wrong model is
one clear error instead of thousands of per-request failures.

A server that is still starting (connection refused, 5xx) is waited for up to
``wait_s``: a batch can be submitted while its serving group comes up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp

from aibrix_operators.batch.error_codes import BatchFailure, CodedFailure
from aibrix_operators.batch.jsonfast import dumps, loads
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.serving.scheduling_policy import HEADER as POLICY_HEADER
from aibrix_operators.serving.scheduling_policy import MIDDLEWARE as POLICY_MIDDLEWARE

log = logging.getLogger(__name__)


class EndpointUnavailable(CodedFailure):
    """The server could not be reached in time — nothing was sent; a task retry may help."""

    error_code, retryable = BatchFailure.ENDPOINT_UNAVAILABLE, True


class ModelNotServed(CodedFailure):
    """The server is up but does not serve the batch's model (retrying will not help)."""

    error_code, retryable = BatchFailure.MODEL_NOT_SERVED, False


class SharedModeRefused(ModelNotServed):
    """Shared mode against a server that does not schedule by priority (retrying will not help)."""

    error_code = BatchFailure.CAPACITY_MODE_REFUSED


async def _list_models(session: aiohttp.ClientSession, url: str) -> tuple[dict[str, Any] | None, str | None]:
    """The /v1/models listing (``None`` when the server does not offer one) and the scheduling
    policy the server reports (serving/scheduling_policy.py; ``None`` when it reports none)."""
    async with session.get(url, allow_redirects=False) as resp:  # the key stays with the endpoint
        if resp.status >= 500 or resp.status in (408, 429):
            raise EndpointUnavailable(f"{url} answered HTTP {resp.status}; the server is not ready")
        policy = resp.headers.get(POLICY_HEADER)
        if resp.status != 200:
            return None, policy  # not every OpenAI-compatible server lists models; don't block on it
        return await resp.json(content_type=None), policy


async def probe_endpoint(
    session: aiohttp.ClientSession, config: DriverConfig, canary: tuple[str, bytes] | None = None
) -> str | None:
    """One health check: ``None`` when the endpoint serves, else what went wrong.

    With a ``canary`` — a request this endpoint already answered, as ``(url, body)`` — the
    check replays it, cut to one output token: that proves the whole serving path (a router
    whose backends are gone still lists models). Without one, ``GET /v1/models``; any answer
    below 500 counts there, since not every server lists models.
    """
    probe_s = min(config.request_timeout_s, max(config.connect_timeout_s, 10.0) * 3)
    timeout = aiohttp.ClientTimeout(total=probe_s)
    url = config.base_url + "/v1/models"
    try:
        if canary is not None:
            url = canary[0]
            async with session.post(url, data=_one_token(url, canary[1]), timeout=timeout,
                                    allow_redirects=False) as resp:
                await resp.read()
                # 404: the route or the model it answered is gone (a restart that lost a LoRA
                # adapter loaded at run time), not the request's fault: it was answered before.
                if resp.status >= 500 or resp.status in (404, 408, 429):
                    return f"replaying an answered request to {url} got HTTP {resp.status}"
                return None
        async with session.get(url, timeout=timeout, allow_redirects=False) as resp:
            await resp.read()
            return f"{url} answered HTTP {resp.status}" if resp.status >= 500 else None
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"{url}: {type(exc).__name__}: {exc}"


def _one_token(url: str, payload: bytes) -> bytes:
    if url.endswith("/v1/responses"):
        # The Responses API names its limit max_output_tokens (and has no n).
        body = loads(payload)
        body.update(max_output_tokens=1, stream=False)
        return dumps(body)
    if not url.endswith("completions"):
        return payload  # embeddings, score, rerank: already one cheap step
    body = loads(payload)
    body.pop("max_completion_tokens", None)
    body.update(max_tokens=1, n=1, stream=False)
    return dumps(body)


async def check_endpoint(config: DriverConfig, model: str | None, wait_s: float = 0.0) -> None:
    url = config.base_url + "/v1/models"
    timeout = aiohttp.ClientTimeout(total=max(config.connect_timeout_s, 5.0) * 3)
    deadline = time.monotonic() + wait_s
    next_note = time.monotonic()
    async with aiohttp.ClientSession(timeout=timeout, headers=config.headers()) as session:
        while True:
            try:
                listing, policy = await _list_models(session, url)
                break
            except (aiohttp.ClientError, TimeoutError, EndpointUnavailable) as exc:
                if time.monotonic() >= deadline:
                    raise EndpointUnavailable(
                        f"cannot reach the inference endpoint {config.base_url} "
                        f"({type(exc).__name__}: {exc}) after waiting {wait_s:.0f}s; check that the "
                        "server is running and the endpoint parameter is right"
                    ) from exc
                if time.monotonic() >= next_note:
                    log.info("waiting for %s to come up (%s)", config.base_url, type(exc).__name__)
                    next_note = time.monotonic() + 10
                await asyncio.sleep(1.0)
    if config.capacity is not None and policy != "priority":
        says = f"reports scheduling policy {policy!r}" if policy else "does not report its scheduling policy"
        raise SharedModeRefused(
            f"{config.base_url} is declared shared with online traffic, but it {says}: "
            "batch requests would not yield to online ones. Start vLLM with --scheduling-policy priority "
            f"--middleware {POLICY_MIDDLEWARE} (the router: --online-first), or remove the endpoint from "
            "[aibrix_batch] shared_endpoints"
        )
    if listing is None:
        return
    served = [m.get("id") for m in listing.get("data", []) if isinstance(m, dict)]
    if model and served and model not in served:
        raise ModelNotServed(
            f"the batch's model {model!r} is not served at {config.base_url}; it serves {served}. "
            "Fix body.model in the input or point endpoint at the right server"
        )
