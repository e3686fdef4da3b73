"""The batch's ``cache_salt`` on every request whose endpoint takes one.

vLLM shares prefix-cache blocks (and this project's kvcache tiers key them) only between
requests with the same ``cache_salt``, so a salt per tenant means one tenant can neither read
nor time another's cached prompts. A line's own salt is kept *under* the batch's: a tenant may
split its own cache further, never join another's. Without a batch salt a line's own goes in a
namespace of its own (``line:own``), so no line can send a bare salt of the Batch API's form.
"""

from __future__ import annotations

from typing import Any

# The endpoints whose vLLM (0.32) request schema has ``cache_salt``: the generating ones, and the
# pooling ones (PoolingBasicRequestMixin: embeddings, score, rerank). A pooling model with causal
# attention reuses cached prefixes like a generating one; an encoder-only one (BERT, MiniLM) has no
# prefix cache, where the salt costs nothing. docs/trust.md, "cache_salt per endpoint".
SALTED_URLS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses",
    "/v1/embeddings", "/v1/score", "/v1/rerank",
})
MAX_SALT_CHARS = 128


def check_cache_salt(salt: str | None) -> str | None:
    """``None`` for no salt; a bad value is the deployment's (or the trigger's) error."""
    if salt is None or salt == "":
        return None
    if not isinstance(salt, str) or len(salt) > MAX_SALT_CHARS or not salt.isprintable():
        raise ValueError(f"cache_salt must be at most {MAX_SALT_CHARS} printable characters")
    return salt


def salted_body(body: dict[str, Any], salt: str | None, url: str) -> dict[str, Any]:
    """The body to send for one line (the line's own dict when nothing changes)."""
    if url not in SALTED_URLS:
        return body
    own = body.get("cache_salt")
    if salt is None:
        return {**body, "cache_salt": f"line:{own}"} if isinstance(own, str) else body
    if own is None:
        return {**body, "cache_salt": salt}
    if isinstance(own, str):
        return {**body, "cache_salt": f"{salt}:{own}"}
    return body  # not a string: vLLM answers the line's own 400, and nothing is cached for it
