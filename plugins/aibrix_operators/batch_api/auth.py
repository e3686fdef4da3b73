"""Bearer API keys → tenants. Keys are stored only as SHA-256 digests.

The deployment keeps a JSON object ``{"<sha256 hex of key>": "<tenant>"}`` in
the Airflow Variable ``aibrix_batch_api_keys`` (metastore, secrets backend, or
``AIRFLOW_VAR_AIBRIX_BATCH_API_KEYS``). API keys are random high-entropy tokens,
so an unsalted fast digest is enough: there is nothing to brute-force from it.
``python -m aibrix_operators.batch_api.auth KEY`` prints a key's digest.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
from collections.abc import Mapping

from aibrix_operators.batch_api.errors import ApiError
from aibrix_operators.batch_api.ids import check_tenant

VARIABLE = "aibrix_batch_api_keys"


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_keyring(text: str | None) -> dict[str, str]:
    """The Variable's JSON → {digest: tenant}; malformed entries raise (a deployment error)."""
    if not text:
        return {}
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"Variable {VARIABLE} must be a JSON object of sha256 digest -> tenant")
    ring: dict[str, str] = {}
    for digest, tenant in data.items():
        digest = str(digest).lower().removeprefix("sha256:")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"Variable {VARIABLE}: keys must be sha256 hex digests, not raw API keys")
        ring[digest] = check_tenant(str(tenant))
    return ring


def authenticate(authorization: str | None, ring: Mapping[str, str]) -> str:
    """The tenant of ``Authorization: Bearer KEY``, or 401 (never echoing the key)."""
    if not authorization:
        raise ApiError(401, "You didn't provide an API key (Authorization: Bearer KEY).", "missing_api_key")
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise ApiError(401, "Authorization must be 'Bearer KEY'.", "invalid_api_key")
    digest = key_digest(key)
    # Compare against every digest in constant time, so timing reveals nothing about near misses.
    tenant = None
    for known, name in ring.items():
        if hmac.compare_digest(known, digest):
            tenant = name
    if tenant is None:
        raise ApiError(401, "Incorrect API key provided.", "invalid_api_key")
    return tenant


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(key_digest(arg))
