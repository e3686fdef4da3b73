"""LoRA adapters from the ``[aibrix_batch]`` section of the Airflow config (the deployment's).

Keys (both optional; without ``lora_adapters`` no batch may name an adapter)::

    [aibrix_batch]
    lora_adapters = /etc/aibrix/lora-adapters.yaml   # the registry (lora/registry.py)
    lora_cache_dir = /var/lib/aibrix/lora            # where adapters are fetched to; the vLLM
                                                     # servers must see it at the same path
    router_admin_token_file = /var/run/secrets/aibrix-router/token   # the P/D router's admin
                                                     # token (router/admin.py), sent only with
                                                     # an adapter load

docs/lora.md explains both.
"""

from __future__ import annotations

from pathlib import Path

from aibrix_operators import config_sections
from aibrix_operators.lora.registry import EMPTY, AdapterRegistry, load_registry
from aibrix_operators.settings.locations import lora_cache_dir

SECTION = config_sections.BATCH


def load_adapter_registry() -> AdapterRegistry:
    """The deployment's adapters; an unset key means none. A bad file raises AdapterRegistryError."""
    from airflow.sdk import conf

    path = (conf.get(SECTION, "lora_adapters", fallback=None) or "").strip()
    return load_registry(path) if path else EMPTY


def adapter_cache_dir() -> Path:
    """The node-local folder adapters are fetched into: the deployment's ``lora_cache_dir``."""
    return lora_cache_dir()


def router_admin_token() -> str | None:
    """The P/D router's admin token (a mounted Secret), or None when the deployment set none."""
    from airflow.sdk import conf

    from aibrix_operators.router.admin import read_token

    raw = (conf.get(SECTION, "router_admin_token_file", fallback=None) or "").strip()
    return read_token(raw).decode() if raw else None
