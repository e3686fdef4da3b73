"""Content keys for KV chunks.

A chunk's key is a chained hash: it covers the chunk's tokens *and* every token before
it, so a key identifies a whole prefix, never a chunk out of context. Every chain starts
from a namespace digest (everything in ``KeyNamespace``: model, weights fingerprint, model
dtype, KV cache dtype, block and chunk size, KV layout, TP size, the ``namespace``
setting) and, when the request has them, its ``cache_salt`` and its LoRA adapter's
identity (name and content fingerprint, kvcache.adapters); so two models, two weight
files, two KV formats, two layouts, two tenants or two adapters never read each other's
blocks. A
storage key adds the TP rank and the *global* layer number (``model.layers.<n>``), so
pipeline stages, which own disjoint layers, never share a key either.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

_DIGEST_BYTES = 16


@dataclass(frozen=True)
class KeyNamespace:
    """Everything that changes the bytes of a KV block for the same tokens."""

    model: str
    dtype: str
    block_size: int
    chunk_tokens: int
    num_layers: int
    kv_heads: int
    head_size: int
    kv_layout: str
    tp_size: int
    extra: str = ""
    # vLLM's cache_dtype setting and the KV spec's torch dtype: fp8_e4m3 and fp8_e5m2 can
    # both be stored as uint8, so the dtype of the tensor alone does not tell them apart.
    kv_cache_dtype: str = "auto"
    # kvcache.fingerprint.weights_fingerprint of the model files, or model_fingerprint.
    weights: str = ""

    def digest(self) -> bytes:
        text = "|".join(
            str(v)
            for v in (
                "kvcache-v2",
                self.model,
                self.weights,
                self.kv_cache_dtype,
                self.dtype,
                self.block_size,
                self.chunk_tokens,
                self.num_layers,
                self.kv_heads,
                self.head_size,
                self.kv_layout,
                self.tp_size,
                self.extra,
            )
        )
        return hashlib.blake2b(text.encode(), digest_size=_DIGEST_BYTES).digest()

    def prefix(self) -> str:
        """Short printable namespace id used as the first component of storage keys."""
        return self.digest().hex()[:16]


def chain_root(namespace: KeyNamespace, salt: str | None = None, adapter: str | None = None) -> bytes:
    """Where a request's chain starts: the namespace digest, mixed with its cache_salt and
    its LoRA adapter's identity (kvcache.adapters.adapter_identity). Without either the
    root is the namespace digest itself, so base-model keys do not change."""
    root = namespace.digest()
    # Distinct personalisations: a salt never equals an adapter identity's mix.
    for person, value in ((b"kvcache-salt", salt), (b"kvcache-lora", adapter)):
        if value:
            h = hashlib.blake2b(root, digest_size=_DIGEST_BYTES, person=person)
            h.update(value.encode())
            root = h.digest()
    return root


def chunk_hashes(
    namespace: KeyNamespace,
    token_ids: Sequence[int],
    max_tokens: int | None = None,
    salt: str | None = None,
    adapter: str | None = None,
) -> list[str]:
    """Chained hashes of the full chunks of ``token_ids`` (at most ``max_tokens`` tokens),
    under the request's ``cache_salt`` (vLLM's per-request tenant isolation) and LoRA
    adapter identity, if any.

    A partial trailing chunk gets no key: only block-aligned chunks are stored.
    """
    size = namespace.chunk_tokens
    limit = len(token_ids) if max_tokens is None else min(len(token_ids), max_tokens)
    parent = chain_root(namespace, salt, adapter)
    out: list[str] = []
    for start in range(0, limit - size + 1, size):
        chunk = token_ids[start : start + size]
        h = hashlib.blake2b(parent, digest_size=_DIGEST_BYTES)
        h.update(struct.pack(f"<{size}q", *chunk))
        parent = h.digest()
        out.append(parent.hex())
    return out


def storage_key(namespace_prefix: str, tp_rank: int, chunk_hash: str, layer: int) -> str:
    """Key of one layer (global layer number) of one chunk for one tensor-parallel rank."""
    return f"kv:{namespace_prefix}:r{tp_rank}:{chunk_hash}:L{layer}"


def layer_number(name: str) -> int | None:
    """The global layer number in a vLLM attention layer name (``model.layers.<n>.…``).

    With pipeline parallelism each stage registers only its own layers, under their global
    numbers, so keys built from it never collide between stages."""
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(found[0]) if found else None
