"""Check the endpoint before sending a shard, so a dead server or a wrong model is
one clear error instead of thousands of per-request failures."""

from __future__ import annotations

import aiohttp

from aibrix_operators.driver.config import DriverConfig


class EndpointUnavailable(Exception):
    """The server cannot be reached (retry later) — nothing was sent."""


class ModelNotServed(Exception):
    """The server is up but does not serve the batch's model (retrying will not help)."""


async def check_endpoint(config: DriverConfig, model: str | None) -> None:
    url = config.base_url + "/v1/models"
    timeout = aiohttp.ClientTimeout(total=max(config.connect_timeout_s, 5.0) * 3)
    try:
        async with aiohttp.ClientSession(timeout=timeout, headers=config.headers()) as session:
            async with session.get(url) as resp:
                if resp.status >= 500 or resp.status in (408, 429):
                    raise EndpointUnavailable(f"{url} answered HTTP {resp.status}; the server is not ready")
                if resp.status != 200:
                    # Not every OpenAI-compatible server lists models; don't block on it.
                    return
                listing = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise EndpointUnavailable(
            f"cannot reach the inference endpoint {config.base_url} ({type(exc).__name__}: {exc}); "
            "check that the server is running and the endpoint parameter is right"
        ) from exc
    served = [m.get("id") for m in listing.get("data", []) if isinstance(m, dict)]
    if model and served and model not in served:
        raise ModelNotServed(
            f"the batch's model {model!r} is not served at {config.base_url}; it serves {served}. "
            "Fix body.model in the input or point endpoint at the right server"
        )
