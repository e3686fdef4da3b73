"""The identity of a LoRA adapter, for the chain root of a LoRA request's keys.

An adapter changes the KV of the layers it targets for the same token ids, so a LoRA
request's keys must differ from the base model's and from every other adapter's. The name
alone is not enough: two deployments (or one, after a redeploy) can load different weights
under the same name, and they must never read each other's blocks. So the identity is the
name plus a fingerprint of the adapter's *content*: every weight file and the
``adapter_config.json`` (rank, alpha and target modules change the KV too) hashed whole.
Adapters are small; one over ``MAX_ADAPTER_BYTES`` is not cached rather than hashed for a
long time on the scheduler's thread. Like the model's fingerprint it ignores paths and
modification times, so copies of one adapter on different nodes agree and can share an L2.

What cannot be fingerprinted (not a local directory, e.g. a hub id that vLLM resolves on
the worker; unreadable; too big; no weight file) raises ``AdapterUnavailable``: the
connector lets the request bypass the cache and counts it under
``kvcache_lora_uncached_requests{reason}``; never an error of the request.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

MAX_ADAPTER_BYTES = 1 << 30
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_CONFIG = "adapter_config.json"
_CACHE_ENTRIES = 64
_READ = 1 << 20

# (path, stat signature of its files) -> fingerprint. The signature is re-read on every
# lookup (a few stat calls), so an adapter whose files are replaced under the same path is
# hashed again instead of keeping its old identity.
_Signature = tuple[tuple[str, int, int, int], ...]
_cache: OrderedDict[tuple[str, _Signature], str] = OrderedDict()
_lock = threading.Lock()
# Adapters already warned about: one log line per adapter, not per request.
_warned: set[str] = set()


class AdapterUnavailable(Exception):
    """The adapter cannot be fingerprinted; ``reason`` is the metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _signature(path: str) -> _Signature:
    root = Path(path)
    if not path or not root.is_dir():  # Path("") is the working directory
        raise AdapterUnavailable("not_local", f"{root} is not a local directory")
    try:
        entries = sorted(
            (e.name, e.stat()) for e in os.scandir(root)
            if e.is_file() and (e.name == _CONFIG or e.name.endswith(_WEIGHT_SUFFIXES))
        )  # fmt: skip
    except OSError as exc:
        raise AdapterUnavailable("unreadable", f"{root}: {exc}") from exc
    if not any(name.endswith(_WEIGHT_SUFFIXES) for name, _ in entries):
        raise AdapterUnavailable("no_weights", f"{root} has no adapter weight file")
    total = sum(st.st_size for _, st in entries)
    if total > MAX_ADAPTER_BYTES:
        raise AdapterUnavailable("too_big", f"{root}: {total} bytes > {MAX_ADAPTER_BYTES}")
    return tuple((name, st.st_size, st.st_mtime_ns, st.st_ino) for name, st in entries)


def _hash_files(root: Path, signature: _Signature) -> str:
    h = hashlib.sha256(b"kvcache-lora-v1\0")
    try:
        for name, size, _, _ in signature:
            h.update(f"{name}\0{size}\0".encode())
            with open(root / name, "rb") as f:
                while block := f.read(_READ):
                    h.update(block)
    except OSError as exc:
        raise AdapterUnavailable("unreadable", f"{root}: {exc}") from exc
    return h.hexdigest()


def adapter_fingerprint(path: str) -> str:
    """sha256 of an adapter directory's config and weight files (names, sizes, bytes);
    raises AdapterUnavailable. Cached per path until its files' stat signature changes."""
    signature = _signature(path)
    root = Path(path)
    key = (str(root.resolve()), signature)
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    fp = _hash_files(root, signature)
    with _lock:
        _cache[key] = fp
        while len(_cache) > _CACHE_ENTRIES:
            _cache.popitem(last=False)
    return fp


def clear_cache() -> None:
    with _lock:
        _cache.clear()
        _warned.clear()


def adapter_identity(lora_request: Any) -> str:
    """What a LoRA request's chain root is mixed with: ``name\0fingerprint``; raises
    AdapterUnavailable when the adapter cannot be fingerprinted (the request is then not
    cached: the connector counts it and carries on).

    vLLM's ``lora_int_id`` is left out: it is a per-server number, and two servers sharing
    an L2 may number the same adapter differently."""
    return f"{lora_request.lora_name}\0{adapter_fingerprint(str(lora_request.lora_path or ''))}"


def first_warning(name: str) -> bool:
    """True the first time an adapter is reported uncacheable: one log line per adapter,
    not per request (bounded, so a stream of made-up names cannot grow it)."""
    with _lock:
        first = name not in _warned and len(_warned) < _CACHE_ENTRIES
        if first:
            _warned.add(name)
    return first
