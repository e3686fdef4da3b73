"""The engine time a shard used: its share of the endpoint's tokens while it ran, times how long.

The endpoint's ``/metrics`` (vLLM's ``prompt_tokens_total`` and ``generation_tokens_total``) is read
when the shard starts sending and when it stops. What the endpoint served meanwhile is the difference;
what the shard was served is its own answers' ``usage``. With other batches and online traffic on the
same endpoint, the shard is charged its share of the wall time, never more than all of it::

    engine_s = elapsed_s * min(1, shard tokens / endpoint tokens served meanwhile)

Summed over a batch's shards (merge), it is the endpoint time the batch used, what a GPU-hour price
(``[aibrix_batch] prices``' ``gpu_hour``) is multiplied by. An endpoint whose page has no token
counters (not vLLM, a router that does not re-export them) gives no figure: ``None``, never a guess.
"""

from __future__ import annotations

import logging

import aiohttp

from aibrix_operators.capacity.signals import parse_page

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0


async def endpoint_tokens(session: aiohttp.ClientSession, base_url: str) -> float | None:
    """The endpoint's served tokens so far (prompt + generation), or None when it does not say."""
    try:
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
        async with session.get(base_url + "/metrics", timeout=timeout, allow_redirects=False) as resp:
            if resp.status != 200:
                return None
            page = parse_page(await resp.text())
    except Exception as exc:  # noqa: BLE001 - a figure we cannot get is left out, never the shard's fault
        log.debug("no token counters from %s/metrics: %s", base_url, exc)
        return None
    if page.prompt_tokens is None and page.generation_tokens is None:
        return None
    return (page.prompt_tokens or 0.0) + (page.generation_tokens or 0.0)


def engine_seconds(
    before: float | None, after: float | None, own_tokens: int, elapsed_s: float
) -> float | None:
    """The shard's engine seconds, or None when the endpoint's counters did not say (or went back:
    a restarted server)."""
    if before is None or after is None or after < before or elapsed_s <= 0:
        return None
    served = after - before
    if served <= 0:
        return 0.0 if own_tokens == 0 else None
    return round(elapsed_s * min(1.0, own_tokens / served), 3)
