"""What the scheduler side tells the worker side each step, and what comes back.

These are the only channel between the two halves (they may live in different
processes), so they hold plain data: chunk hashes and block ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache._compat import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class ChunkTransfer:
    """One chunk to move: its key, and the paged-cache block for each of its blocks.

    ``blocks`` pairs (index of the block inside the chunk, block id in vLLM's cache); a
    load may skip leading blocks that vLLM's own prefix cache already holds.
    """

    chunk_hash: str
    blocks: list[tuple[int, int]]
    req_id: str = ""
    # Saves only: block ids loaded in the same step that the request's KV attends to (its
    # own or, with vLLM's prefix caching, shared with a loading request). If any of their
    # loads fails, this save is dropped.
    deps: list[int] = field(default_factory=list)


@dataclass
class KVCacheStepMetadata(KVConnectorMetadata):
    loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)
    # Tokens per chunk, so the worker never has to guess.
    chunk_tokens: int = 0
    # P/D handoffs the scheduler resolved since the last step: (outcome, seconds pending).
    # Counted by the worker side, whose process serves the metrics.
    handoffs: list[tuple[str, float]] = field(default_factory=list)
    # Lookahead prefetch: per waiting request, the chunk hashes to fetch from L2 into L1, in
    # prompt order (the worker stops a list at its first chunk L2 does not hold: the chain's
    # later chunks cannot be usable without it). Each hash is asked once until reported.
    prefetch: list[list[str]] = field(default_factory=list)


@dataclass
class KVCacheWorkerReport(KVConnectorWorkerMetadata):
    """Chunks the worker committed to / dropped from L1, and failed loads, since its last report."""

    stored: set[str] = field(default_factory=set)
    evicted: set[str] = field(default_factory=set)
    # Requests with a failed load or a dropped save: vLLM recomputes them (it rewinds every
    # request holding a failed block), so their saves must restart.
    failed_reqs: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVCacheWorkerReport)
        # With several TP ranks a chunk is only usable when every rank has it; the
        # scheduler index is an optimisation (a wrong guess is a recompute), so union it.
        return KVCacheWorkerReport(
            self.stored | other.stored, self.evicted | other.evicted, self.failed_reqs | other.failed_reqs
        )
