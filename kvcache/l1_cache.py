"""L1 as the worker keeps it: which chunk is in which slab slot, and what changed.

The index (``tiers/l1.py``: byte-bounded, LRU or S3-FIFO) maps a chunk key to an
``L1Chunk`` (its slot and check values) in the engine's slab (``tiers/slab.py``). The
index holds one reference to each slot it lists; an entry it drops (evicted, replaced)
gives that reference back. A new chunk gets a free slot, evicting from the index while
none is free. The chunk hashes that entered or left L1 since the last report tell the
scheduler where chunks are (``KVCacheWorker.take_report``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvcache import metrics
from kvcache.config import KVCacheSettings
from kvcache.tiers import L1Pool
from kvcache.transfer_engine import TransferEngine
from kvcache.transfer_jobs import L1Chunk


class L1Cache:
    """L1's index over the engine's slab slots, and the chunks touched since the last report."""

    def __init__(self, settings: KVCacheSettings, engine: TransferEngine) -> None:
        self.engine = engine
        self.index: L1Pool[L1Chunk] = L1Pool(
            settings.l1_capacity_bytes, settings.l1_eviction, on_drop=self._dropped
        )
        self._touched: set[str] = set()  # chunk hashes put into / evicted from L1
        self._lock = threading.Lock()

    def _dropped(self, key: str, chunk: L1Chunk) -> None:
        assert self.engine.slab is not None
        self.engine.slab.unref(chunk.slot)

    def alloc_slot(self, key: str) -> int | None:
        """A slot for a new chunk, evicting from L1 when every slot is taken (None: all
        remaining slots are held by loads or queued L2 writes)."""
        slab = self.engine.slab
        assert slab is not None
        slot = slab.alloc(key)
        while slot is None:
            gone = self.index.evict_one()
            if gone is None:
                break
            self.note_evicted([gone])
            slot = slab.alloc(key)
        return slot

    def note_evicted(self, keys: list[str]) -> None:
        if not keys:
            return
        metrics.EVICTIONS.labels("l1").inc(len(keys))
        with self._lock:
            self._touched.update(k.rsplit(":", 1)[1] for k in keys)

    def touch(self, chunk_hashes: Iterable[str]) -> None:
        """Report these chunks' place in L1 (in or out) with the next report."""
        with self._lock:
            self._touched.update(chunk_hashes)

    def pin(self, key: str) -> L1Chunk | None:
        """The chunk under ``key`` with one more reference to its slot (the caller's to
        give back), or None when L1 does not hold it."""
        slab = self.engine.slab
        assert slab is not None
        return self.index.get(key, on_hit=lambda c: slab.ref(c.slot))

    def keep(self, key: str, chunk: L1Chunk) -> bool:
        """Put ``chunk`` in the index: True when it is there afterwards (the caller's slot
        reference now belongs to the index), False when the index did not take it."""
        assert self.engine.slab is not None
        self.note_evicted(self.index.put(key, chunk, self.engine.slab.slot_bytes))
        return key in self.index

    def take_touched(self) -> set[str]:
        with self._lock:
            touched, self._touched = self._touched, set()
        return touched
