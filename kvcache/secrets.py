"""Secrets of the connector: read from the environment or a mounted file, never from
``--kv-transfer-config`` (which is visible in ``ps``, pod specs and vLLM's startup log),
and never logged.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from kvcache.codec import Mac

if TYPE_CHECKING:
    from kvcache.config import KVCacheSettings

# Under "vllm." so that records reach the handlers vLLM configures in its processes.
log = logging.getLogger(f"vllm.{__name__}")


def read_secret(env_name: str, file_path: str) -> str | None:
    """The secret in environment variable ``env_name``, else in ``file_path`` (a mounted
    Kubernetes secret: trailing newline stripped), else None."""
    if env_name:
        value = os.environ.get(env_name)
        if value:
            return value
    if file_path:
        with open(file_path, encoding="utf-8") as f:
            value = f.read().strip()
        if value:
            return value
    return None


def mask_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs and errors)."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.netloc.rsplit("@", 1)[1]
        return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
    except ValueError:
        return "<unparseable url>"


def mask_text(text: str, *secrets: str | None) -> str:
    """``text`` with every given secret replaced by ``***`` (e.g. in exception messages)."""
    for s in secrets:
        if s:
            text = text.replace(s, "***")
    return text


def l2_mac(settings: KVCacheSettings) -> Mac | None:
    """The MAC for L2 records, when a key is configured (environment or file)."""
    key = read_secret(settings.l2_mac_key_env, settings.l2_mac_key_file)
    if key is None:
        return None
    log.info("kvcache: L2 records are authenticated (%s MAC)", settings.l2_mac_alg)
    return Mac(key.encode(), settings.l2_mac_alg)
