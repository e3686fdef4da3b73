"""Content keys for KV chunks.

A chunk's key is a chained hash: it covers the chunk's tokens *and* every token before
it, so a key identifies a whole prefix, never a chunk out of context. Every chain starts
from a namespace digest (model, dtype, block size, chunk size, KV layout, parallel
layout), so two models or two layouts can never read each other's blocks.
"""

from __future__ import annotations

import hashlib
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

    def digest(self) -> bytes:
        text = "|".join(
            str(v)
            for v in (
                "kvcache-v1",
                self.model,
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


def chunk_hashes(
    namespace: KeyNamespace, token_ids: Sequence[int], max_tokens: int | None = None
) -> list[str]:
    """Chained hashes of the full chunks of ``token_ids`` (at most ``max_tokens`` tokens).

    A partial trailing chunk gets no key: only block-aligned chunks are stored.
    """
    size = namespace.chunk_tokens
    limit = len(token_ids) if max_tokens is None else min(len(token_ids), max_tokens)
    parent = namespace.digest()
    out: list[str] = []
    for start in range(0, limit - size + 1, size):
        chunk = token_ids[start : start + size]
        h = hashlib.blake2b(parent, digest_size=_DIGEST_BYTES)
        h.update(struct.pack(f"<{size}q", *chunk))
        parent = h.digest()
        out.append(parent.hex())
    return out


def storage_key(namespace_prefix: str, tp_rank: int, chunk_hash: str, layer: int) -> str:
    """Key of one layer of one chunk for one tensor-parallel rank."""
    return f"kv:{namespace_prefix}:r{tp_rank}:{chunk_hash}:L{layer}"
