"""The deployment's LoRA adapters: which names a batch may use, their base model, where they live.

A batch line names an adapter in ``body.model``; only adapters listed here exist, so a trigger
can never make a worker or a server fetch from a place of its choosing. The file is the
deployment's (``[aibrix_batch] lora_adapters``, e.g. a ConfigMap), YAML or JSON::

    adapters:
      - name: sql-lora                     # what body.model says, and vLLM's lora_name
        base_model: tiny-llama             # the served name of the model it was trained on
        uri: s3://adapters/sql-lora/v3/    # a folder with the files and model-manifest.json
        manifest_sha256: 5f2c...           # sha256 of that manifest: every file's digest is in it

The manifest is the model fetcher's (``serving/model_manifest.py``): the adapter's bytes are
checked file by file against it, and the manifest itself against the pin recorded here, so a
changed object in the store fails the load instead of being served.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aibrix_operators.batch.error_codes import BatchFailure, CodedFailure

# vLLM's lora_name and a folder name of the cache: no separators, no dot-only names.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class AdapterRegistryError(CodedFailure, ValueError):
    """The registry file is unusable; the message names the entry and the key."""

    error_code, retryable = BatchFailure.INVALID_ADAPTER_REGISTRY, False


@dataclass(frozen=True)
class Adapter:
    name: str
    base_model: str
    uri: str  # s3://bucket/prefix/ holding the files and model-manifest.json
    manifest_sha256: str

    @property
    def version(self) -> str:
        """A short name of this adapter's content: a changed adapter loads from a new folder."""
        return self.manifest_sha256[:16]


@dataclass(frozen=True)
class AdapterRegistry:
    adapters: Mapping[str, Adapter]
    source: str = "no adapter registry"

    def __bool__(self) -> bool:
        return bool(self.adapters)

    def bases(self) -> dict[str, str]:
        """Adapter name -> base model: what validation needs."""
        return {a.name: a.base_model for a in self.adapters.values()}

    def get(self, name: str) -> Adapter:
        try:
            return self.adapters[name]
        except KeyError:
            raise AdapterRegistryError(f"adapter {name!r} is not in {self.source}") from None


EMPTY = AdapterRegistry({})


def _entry(raw: Any, where: str) -> Adapter:
    if not isinstance(raw, dict):
        raise AdapterRegistryError(f"{where}: an adapter is a mapping with name, base_model, uri, "
                                   "manifest_sha256")
    unknown = sorted(set(raw) - {"name", "base_model", "uri", "manifest_sha256"})
    if unknown:
        raise AdapterRegistryError(f"{where}: unknown key(s) {unknown}")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise AdapterRegistryError(f"{where}: name {name!r} must be 1-128 letters, digits, '.', '_' "
                                   "or '-', starting with a letter or digit")
    base = raw.get("base_model")
    if not isinstance(base, str) or not base.strip():
        raise AdapterRegistryError(f"{where} ({name}): base_model must be the served name of its base")
    if base == name:
        raise AdapterRegistryError(f"{where} ({name}): an adapter cannot have its own name as base_model")
    uri = raw.get("uri")
    if not isinstance(uri, str) or not uri.startswith("s3://") or len(uri.split("/", 3)) < 4 \
            or not uri.split("/", 3)[3].strip("/"):
        raise AdapterRegistryError(f"{where} ({name}): uri {uri!r} must be s3://bucket/prefix/ of the "
                                   "adapter's folder")
    pin = raw.get("manifest_sha256")
    if not isinstance(pin, str) or not _HEX64.fullmatch(pin):
        raise AdapterRegistryError(f"{where} ({name}): manifest_sha256 must be 64 lowercase hex digits "
                                   "(sha256sum of the adapter's model-manifest.json)")
    return Adapter(name, base, uri.rstrip("/") + "/", pin)


def parse_registry(data: Any, source: str) -> AdapterRegistry:
    """The registry from a parsed YAML/JSON document; a bad entry names itself."""
    entries: Iterable[Any]
    if data is None:
        entries = ()
    elif isinstance(data, dict) and set(data) <= {"adapters"}:
        entries = data.get("adapters") or ()
        if not isinstance(entries, list):
            raise AdapterRegistryError(f"{source}: 'adapters' must be a list")
    else:
        raise AdapterRegistryError(f"{source}: expected a mapping with one key, 'adapters'")
    adapters: dict[str, Adapter] = {}
    bases: set[str] = set()
    for k, raw in enumerate(entries):
        adapter = _entry(raw, f"{source}: adapters[{k}]")
        if adapter.name in adapters:
            raise AdapterRegistryError(f"{source}: adapters[{k}]: name {adapter.name!r} is listed twice")
        adapters[adapter.name] = adapter
        bases.add(adapter.base_model)
    clash = bases & set(adapters)
    if clash:
        raise AdapterRegistryError(f"{source}: {sorted(clash)} are both an adapter and a base model")
    return AdapterRegistry(adapters, source)


def load_registry(path: str | Path) -> AdapterRegistry:
    """Read the registry file (YAML; JSON is YAML too)."""
    import yaml

    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise AdapterRegistryError(f"cannot read the adapter registry {source}: {exc}") from exc
    try:
        data = yaml.safe_load(text) if not source.endswith(".json") else json.loads(text)
    except (yaml.YAMLError, ValueError) as exc:
        raise AdapterRegistryError(f"{source} is not valid YAML/JSON: {exc}") from exc
    return parse_registry(data, source)
