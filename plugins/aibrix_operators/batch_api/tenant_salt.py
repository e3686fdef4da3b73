"""One vLLM ``cache_salt`` per Batch API tenant.

vLLM's prefix cache (and the kvcache tiers, keyed the same way) shares blocks between any two
requests with the same prompt prefix and the same ``cache_salt``. Without a salt one tenant can
time another's prompts: a cache hit answers faster and shows in ``cached_tokens``. The API puts
``HMAC-SHA256(key, tenant)`` on every request of a tenant's batch (driver/cache_salt.py), so a
tenant keeps its own cache hits across batches and never meets another's blocks.

The salt must be unguessable: the DAG's ``cache_salt`` param is a trigger input like any other,
and someone who could compute a tenant's salt could join that tenant's cache. The key is the
Airflow Variable ``aibrix_batch_cache_salt_key`` (a secrets backend works). Without it every
api-server process draws its own random key: isolation holds, but a tenant's batches created
through different processes (or before a restart) no longer share cache hits.
``api_cache_salt = off`` in ``[aibrix_batch]`` sends no salt at all.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections.abc import Callable

log = logging.getLogger(__name__)
VARIABLE = "aibrix_batch_cache_salt_key"
MODES = ("per-tenant", "off")


def tenant_cache_salt(key: bytes, tenant: str) -> str:
    return "tenant-" + hmac.new(key, tenant.encode(), hashlib.sha256).hexdigest()[:32]


def load_cache_salt_key(mode: str | None, read_variable: Callable[[], str | None]) -> bytes | None:
    """The HMAC key for ``api_cache_salt`` = ``mode``; ``None`` when the deployment turned it off."""
    mode = (mode or "per-tenant").strip()
    if mode not in MODES:
        raise ValueError(f"[aibrix_batch] api_cache_salt must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "off":
        return None
    try:
        text = read_variable()
    except Exception as exc:  # noqa: BLE001 - fall back to a random key: isolation must not fail open
        log.error("Variable %s unreadable (%s): using a random per-process key", VARIABLE,
                  type(exc).__name__)
        text = None
    if text:
        return text.encode()
    log.warning("Variable %s is not set: tenants' cache salts use a random key of this process, "
                "so a tenant's batches share prefix-cache hits only within it; set the Variable "
                "to a random string (e.g. `openssl rand -hex 32`) to keep them across processes",
                VARIABLE)
    return secrets.token_bytes(32)
