"""The router's admin surface: who may load an adapter, and which adapters exist.

The router serves online clients (shared mode) and batch drivers on one port, so whoever can
send a chat request can reach every route. ``POST /v1/load_lora_adapter`` changes what every
instance serves and where the router sends requests, so it is not theirs to call:

- **A deployment token.** The route answers only a request whose ``X-AIBrix-Admin-Token``
  header equals the token in ``--admin-token-file`` (a Secret the Airflow workers mount too,
  ``[aibrix_batch] router_admin_token_file``). Without the flag the route is off (403): fail
  closed. A separate header, not ``Authorization``: that one carries the inference key, which
  online clients hold as well.
- **The deployment's registry decides what may load.** Only names of the adapter registry
  (``--lora-registry``, the same file as ``[aibrix_batch] lora_adapters``), each only from its
  own verified folder ``<--lora-cache-dir>/<name>/<manifest digest[:16]>`` (where the dispatch
  task fetched and checked it: ``lora/serving.py``). A served base model is never an adapter.
  So the names the router remembers are bounded by the registry, and one adapter's name can
  never be pointed at another's weights. The registry file is read on every load (loads are
  rare), so a new adapter version published to it loads without restarting the router.

docs/trust.md ("the router's admin surface") has the table row and its tests.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from pathlib import Path

from aibrix_operators.lora.registry import AdapterRegistryError, load_registry

TOKEN_HEADER = "X-AIBrix-Admin-Token"
# A token shorter than this is a configuration mistake (a placeholder, an empty Secret key).
MIN_TOKEN_BYTES = 16


class AdminConfigError(ValueError):
    """The router's admin settings are unusable; the message says which and how to fix it."""


@dataclass(frozen=True)
class Refusal:
    status: int
    code: str
    message: str


@dataclass(frozen=True)
class AdminPolicy:
    """What the admin routes accept; ``token=None`` turns them off."""

    token: bytes | None = field(default=None, repr=False)
    registry: Path | None = None
    cache_dir: Path | None = None

    def authorize(self, presented: str | None) -> Refusal | None:
        if self.token is None:
            return Refusal(403, "admin_disabled", "loading adapters through the router is off: start it "
                           "with --admin-token-file (ROUTER_ADMIN_TOKEN_FILE), docs/lora.md")
        # compare_digest: no timing signal of how much of a guess was right.
        if presented is None or not hmac.compare_digest(presented.encode(), self.token):
            return Refusal(401, "invalid_admin_token",
                           f"send the deployment's router admin token in the {TOKEN_HEADER} header")
        return None

    def folder_of(self, name: str, path: str, base_models: set[str]) -> Refusal | None:
        """None when ``path`` is the registry's verified folder of adapter ``name``."""
        if name in base_models:
            return Refusal(400, "not_an_adapter", f"{name!r} is a base model the instances serve, not an "
                           "adapter")
        if self.registry is None or self.cache_dir is None:
            return Refusal(403, "no_adapter_registry", "the router has no adapter registry: start it with "
                           "--lora-registry and --lora-cache-dir (docs/lora.md)")
        try:
            registry = load_registry(self.registry)
        except AdapterRegistryError as exc:
            return Refusal(503, "adapter_registry_unreadable", str(exc))
        try:
            adapter = registry.get(name)
        except AdapterRegistryError as exc:
            return Refusal(404, "unknown_adapter", str(exc))
        expected = str(self.cache_dir / adapter.name / adapter.version)
        if path != expected:
            return Refusal(400, "lora_path_mismatch", f"adapter {name!r} loads only from its verified "
                           f"folder {expected}")
        return None


def read_token(path: str | Path) -> bytes:
    """The admin token in ``path`` (a mounted Secret), without a trailing newline."""
    try:
        token = Path(path).read_bytes().strip()
    except OSError as exc:
        raise AdminConfigError(f"cannot read the router admin token file {path}: {exc}") from exc
    if len(token) < MIN_TOKEN_BYTES:
        raise AdminConfigError(f"the router admin token in {path} has {len(token)} bytes; use at least "
                               f"{MIN_TOKEN_BYTES} random ones (e.g. `openssl rand -hex 32`)")
    return token
