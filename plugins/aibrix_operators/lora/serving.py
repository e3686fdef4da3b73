"""Make a LoRA adapter present on a vLLM server before a shard that names it runs.

1. **Fetch and verify**: the model fetcher (``serving/model_fetch.py``) copies the adapter's
   folder from the deployment's ``s3://`` URI to ``<cache>/<name>/<manifest digest>/``,
   checking every file against the manifest and the manifest against the digest the registry
   pins. Resumable, and a verified copy is not downloaded again. A file lock per folder: two
   shards of one adapter on one node fetch it once.
2. **Load**: ``POST /v1/load_lora_adapter`` with that folder, unless ``GET /v1/models`` already
   lists the adapter from that very folder. vLLM reads the folder itself, so the cache must be
   at the same path on the server (one node, or a shared volume: docs/lora.md).

A changed adapter has a new manifest digest, so it loads from a new folder; vLLM then replaces
the old weights under the name (``load_inplace``) and never mixes the two (vLLM's advice:
"load changed weights from a new path"). A bad adapter or a server that refuses it raises
``AdapterLoadFailed``; a server that does not answer ``AdapterServerUnreachable`` and a store that
cannot be read ``AdapterStoreUnavailable`` (outages, retried); each message names the adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from aibrix_operators.batch.error_codes import BatchFailure, CodedFailure
from aibrix_operators.lora.registry import Adapter
from aibrix_operators.router.admin import TOKEN_HEADER
from aibrix_operators.serving.model_fetch import EXIT_STORE, FetchError, FetchOptions, fetch_model

log = logging.getLogger(__name__)

RUNTIME_LORA_HINT = ("start vLLM with --enable-lora (and --max-lora-rank / --max-loras to fit the "
                     "adapters) and the environment VLLM_ALLOW_RUNTIME_LORA_UPDATING=true")


class AdapterLoadFailed(CodedFailure):
    """The adapter could not be made present on the server; the shard cannot run."""

    error_code, retryable = BatchFailure.ADAPTER_LOAD_FAILED, False


class AdapterServerUnreachable(CodedFailure):
    """The server did not answer the load: an outage, which a retry of the task may outlast."""

    error_code, retryable = BatchFailure.ENDPOINT_UNAVAILABLE, True


class AdapterStoreUnavailable(CodedFailure):
    """The adapter store refused or could not be reached: an outage, retried like one."""

    error_code, retryable = BatchFailure.STORAGE_ERROR, True


def adapter_dir(cache_dir: Path, adapter: Adapter) -> Path:
    return cache_dir / adapter.name / adapter.version


@contextmanager
def _adapter_lock(cache_dir: Path, adapter: Adapter) -> Iterator[int]:
    """The lock file of the adapter's version, with ``<cache>/<name>/<version>/`` made; no link
    inside the cache is followed. The cache is a volume every worker can write, so a link planted
    at ``<name>`` or at the lock's name would make us create or lock files where it points: the
    fetch fails naming it instead (the fetcher itself follows no link below ``<version>/``)."""
    cache_dir.mkdir(parents=True, exist_ok=True)  # the deployment's path: its links are its own
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(cache_dir / adapter.name)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        folder = os.open(cache_dir / adapter.name, flags)
    except OSError as exc:
        raise AdapterLoadFailed(_not_a_folder(cache_dir / adapter.name, exc)) from exc
    try:
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(adapter.version, dir_fd=folder)
            lock = os.open(f"{adapter.version}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                           0o644, dir_fd=folder)
        except OSError as exc:
            raise AdapterLoadFailed(_not_a_folder(cache_dir / adapter.name / adapter.version, exc)) from exc
        try:
            yield lock
        finally:
            os.close(lock)
    finally:
        os.close(folder)


def _not_a_folder(path: Path, exc: OSError) -> str:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return (f"{path} (or its .lock) in the LoRA cache is a symbolic link or not a folder; the cache "
                "follows no links: remove it and run the task again")
    return f"cannot prepare {path} in the LoRA cache: {exc}"


def fetch_adapter(adapter: Adapter, cache_dir: Path, s3_client: Any = None) -> Path:
    """The adapter's verified local folder, fetched if needed (blocking)."""
    dest = adapter_dir(cache_dir, adapter)
    with _adapter_lock(cache_dir, adapter) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            # reverify: the cache is a volume every worker can write, so its journal's (size,
            # mtime) proves nothing; every file is hashed on every load (adapters are small) and
            # one whose bytes are not the manifest's is downloaded again and verified.
            report = fetch_model(adapter.uri, dest, manifest_sha256=adapter.manifest_sha256,
                                 client=s3_client, options=FetchOptions(reverify=True))
        except FetchError as exc:
            what = f"LoRA adapter {adapter.name!r} ({adapter.uri}): {exc}"
            if exc.exit_code == EXIT_STORE:
                raise AdapterStoreUnavailable(f"{what}; the task's retry fetches it again") from exc
            raise AdapterLoadFailed(what) from exc
    log.info("LoRA adapter %s: %d file(s) verified in %s (%d downloaded now)", adapter.name,
             report.files, dest, len(report.fetched))
    return dest


async def _loaded_from(session: aiohttp.ClientSession, base_url: str, name: str) -> str | None:
    """The folder the server serves adapter ``name`` from, or None if it does not serve it."""
    async with session.get(f"{base_url}/v1/models") as resp:
        if resp.status != 200:
            return None
        listing = await resp.json(content_type=None)
    for card in listing.get("data", []) if isinstance(listing, dict) else []:
        if isinstance(card, dict) and card.get("id") == name:
            return str(card.get("root") or "")
    return None


async def load_on_server(
    base_url: str, headers: dict[str, str], adapter: Adapter, folder: Path, timeout_s: float = 300.0,
    admin_token: str | None = None,
) -> bool:
    """Load ``folder`` as ``adapter.name`` on the server; False when it already served that folder.

    ``admin_token`` (the deployment's router admin token) goes on the load request alone: the P/D
    router refuses loads without it (router/admin.py); a plain vLLM ignores the header."""
    try:
        return await _load(base_url, headers, adapter, folder, timeout_s, admin_token)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise AdapterServerUnreachable(
            f"LoRA adapter {adapter.name!r}: cannot reach {base_url} to load it "
            f"({type(exc).__name__}: {exc}); the task's retry loads it again") from exc


async def _load(base_url: str, headers: dict[str, str], adapter: Adapter, folder: Path,
                timeout_s: float, admin_token: str | None) -> bool:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        current = await _loaded_from(session, base_url, adapter.name)
        if current == str(folder):
            return False
        body = {"lora_name": adapter.name, "lora_path": str(folder), "load_inplace": current is not None}
        admin = {TOKEN_HEADER: admin_token} if admin_token else {}
        async with session.post(f"{base_url}/v1/load_lora_adapter", json=body, headers=admin) as resp:
            if resp.status == 200:
                return True
            text = (await resp.text())[:500]
        # Another shard of the batch may have loaded it between the listing and the load.
        if resp.status == 400 and await _loaded_from(session, base_url, adapter.name) == str(folder):
            return False
    if resp.status in (404, 405):
        raise AdapterLoadFailed(
            f"LoRA adapter {adapter.name!r}: {base_url} does not load adapters at run time "
            f"(POST /v1/load_lora_adapter answered {resp.status}); {RUNTIME_LORA_HINT}")
    raise AdapterLoadFailed(
        f"LoRA adapter {adapter.name!r}: {base_url} refused to load it from {folder} "
        f"(HTTP {resp.status}: {text.strip()}); check that it is an adapter of the served base "
        f"model {adapter.base_model!r} and fits --max-lora-rank")


async def ensure_adapter(
    base_url: str, headers: dict[str, str], adapter: Adapter, cache_dir: Path, s3_client: Any = None,
    admin_token: str | None = None,
) -> Path:
    """Fetch, verify and load ``adapter`` on the server at ``base_url``; its folder."""
    folder = await asyncio.to_thread(fetch_adapter, adapter, cache_dir, s3_client)
    loaded = await load_on_server(base_url, headers, adapter, folder, admin_token=admin_token)
    log.info("LoRA adapter %s %s on %s", adapter.name, "loaded" if loaded else "already served",
             base_url)
    return folder
