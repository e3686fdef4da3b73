"""One vLLM ``cache_salt`` per Batch API tenant.

vLLM's prefix cache (and the kvcache tiers, keyed the same way) shares blocks between any two
requests with the same prompt prefix and the same ``cache_salt``. Without a salt one tenant can
time another's prompts: a cache hit answers faster and shows in ``cached_tokens``. The API puts
``HMAC-SHA256(key, tenant)`` on every request of a tenant's batch (driver/cache_salt.py), so a
tenant keeps its own cache hits across batches and never meets another's blocks.

The salt never appears in a run: the API writes a *claim* into the run's conf (the tenant and
``HMAC(key, run id, tenant)``), and the dispatch task verifies it against its own run id and
derives the salt itself (``salt_for_run``). Someone who may read runs and trigger the DAG can
copy a claim, but it verifies in no other run; and the DAG's ``cache_salt`` param, a trigger
input like any other, is sent as ``param:<salt>``, so no trigger can name a tenant's salt even
if it learnt one. The key is the Airflow Variable ``aibrix_batch_cache_salt_key`` (a secrets
backend works), read by the api-server and by the workers; when it is not set the api-server
stores a random one there. ``api_cache_salt = off`` in ``[aibrix_batch]`` sends no salt at all.
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
# Where the claim is, inside the API's part of the run conf (batches.API_CONF_KEY).
CLAIM_KEY = "cache_salt_claim"
PARAM_PREFIX = "param:"


class SaltClaimRefused(ValueError):
    """A run's salt claim does not verify: copied from another run, or the key changed."""


def tenant_cache_salt(key: bytes, tenant: str) -> str:
    return "tenant-" + hmac.new(key, tenant.encode(), hashlib.sha256).hexdigest()[:32]


def _tag(key: bytes, run_id: str, tenant: str) -> str:
    # "claim" keeps tags and salts apart: a tag is never a valid salt, nor a salt a tag.
    message = b"\0".join((b"claim", run_id.encode(), tenant.encode()))
    return hmac.new(key, message, hashlib.sha256).hexdigest()[:32]


def salt_claim(key: bytes, run_id: str, tenant: str) -> dict[str, str]:
    """What the API writes into a run's conf in place of the salt."""
    return {"tenant": tenant, "tag": _tag(key, run_id, tenant)}


def salt_for_run(
    run_id: str, claim: object, param_salt: str | None, read_key: Callable[[], bytes | None]
) -> str | None:
    """The batch salt a run's requests carry: the tenant's if the run holds a claim that verifies
    for *this* run id; else the trigger's ``cache_salt`` param in a namespace of its own."""
    if claim is None:
        return PARAM_PREFIX + param_salt if param_salt else None
    if not (isinstance(claim, dict) and isinstance(claim.get("tenant"), str)
            and isinstance(claim.get("tag"), str)):
        raise SaltClaimRefused(f"the run's {CLAIM_KEY} is malformed (expected tenant and tag)")
    key = read_key()
    if key is None:
        raise SaltClaimRefused(
            f"the run carries a Batch API {CLAIM_KEY} but the Variable {VARIABLE} is not readable "
            "by this worker: give the workers the same Variable (or secrets backend) as the api-server"
        )
    if not hmac.compare_digest(claim["tag"], _tag(key, run_id, claim["tenant"])):
        raise SaltClaimRefused(
            f"the run's {CLAIM_KEY} does not verify for run {run_id!r}: it was copied from another "
            f"run, or the Variable {VARIABLE} changed after the batch was created"
        )
    return tenant_cache_salt(key, claim["tenant"])


def load_cache_salt_key(
    mode: str | None, read_variable: Callable[[], str | None], write_variable: Callable[[str], None]
) -> bytes | None:
    """The HMAC key for ``api_cache_salt`` = ``mode``; ``None`` when the deployment turned it off.

    Without the Variable a random key is stored there: the workers verify claims with it, so a
    key of this process alone would fail every batch. Read back after writing, so that two
    api-server processes starting together settle on the same key.
    """
    mode = (mode or "per-tenant").strip()
    if mode not in MODES:
        raise ValueError(f"[aibrix_batch] api_cache_salt must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "off":
        return None
    text = read_variable()
    if not text:
        log.warning("Variable %s is not set: storing a random key there (set it yourself, e.g. to "
                    "`openssl rand -hex 32`, to choose where it lives)", VARIABLE)
        write_variable(secrets.token_hex(32))
        text = read_variable()
    if not text:
        raise ValueError(f"Variable {VARIABLE} could not be stored; set it (e.g. `openssl rand -hex 32`)")
    return text.encode()
