"""Worker side: what moves between vLLM's paged cache and the tiers, and what it did.

``KVCacheWorker`` keeps the bookkeeping and the per-step orchestration of vLLM's hooks:
L1 (``l1_cache.py``: the index over slab slots, allocation with eviction, the chunks
touched since the last report), failed loads and the saves they poison
(``failed_loads.py``), hits, misses, what enters L1 and L2, reports and stats. The bytes
move behind a job API: a step's ``LoadJob`` and ``StoreJob`` (``transfer_jobs.py``) on a
``TransferEngine`` (``transfer_engine.py``: paged layers, slab memory, threads, L2 reads,
checksums, copies).

Pipelined mode (default):
- ``start_load`` issues the step's loads layer by layer ahead of compute (``prefetch_window``
  layers ahead); ``wait_for_layer`` waits for that one layer. On CUDA the copies run on a
  side stream from pinned memory and the compute stream waits on an event (the host does
  not block). On CPU there is no copy engine to overlap with and every thread competes
  with compute for the same cores, so L1 copies run on the compute thread, all layers in
  ``start_load`` (interleaving them with the layers' compute measured slower); only L2
  fetches (network or disk waits) go to background threads, each layer's copy then runs
  in ``wait_for_layer``.
- ``save_layer`` on CUDA queues that layer's copy-out on the save stream right after it
  is computed (the host returns at once); ``wait_for_save`` is the only barrier. On CPU
  the copy-outs wait for that barrier, as in sync mode: copying layer L between the
  layers' compute measured ~13% slower first sends than copying all layers after the
  forward (the same effect as for loads: docs/kvcache.md). Finished chunks go to L1 at
  once and to L2 through the write-behind queue.
Sync mode does the same work with no overlap: all loads before the forward, all
copy-outs in ``wait_for_save``. Both modes share every line of the data path (the jobs
and the engine).

A chunk that cannot be loaded (absent, unreachable tier, key/layout/checksum mismatch)
has its blocks reported through ``take_load_errors`` so vLLM recomputes them.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from kvcache import metrics
from kvcache.config import KVCacheSettings
from kvcache.failed_loads import FailedLoads
from kvcache.keys import layer_number
from kvcache.l1_cache import L1Cache
from kvcache.lookahead import LookaheadPrefetcher
from kvcache.metadata import ChunkTransfer, KVCacheStepMetadata, KVCacheWorkerReport
from kvcache.secrets import l2_mac
from kvcache.tiers import L2Store
from kvcache.tiers.slab import SlabPool
from kvcache.tiers.writer import L2Writer
from kvcache.transfer_engine import TransferEngine, log_once
from kvcache.transfer_jobs import L1Chunk, LoadJob, StoreJob

# Under "vllm." so that records reach the handlers vLLM configures in its processes.
log = logging.getLogger(f"vllm.{__name__}")

__all__ = ["KVCacheWorker", "L1Chunk"]


def _layer_order(names: list[str]) -> list[str]:
    """Layer names sorted by their layer number (vLLM names: model.layers.<n>.self_attn.attn)."""
    return sorted(names, key=lambda name: (layer_number(name) or 0, name))


def _global_layer_ids(names: list[str]) -> list[int]:
    """Each layer's global number (what storage keys use); positions if a name has none."""
    nums = [layer_number(n) for n in names]
    if any(n is None for n in nums) or len(set(nums)) != len(nums):
        return list(range(len(names)))
    return [n for n in nums if n is not None]


class KVCacheWorker:
    def __init__(
        self,
        settings: KVCacheSettings,
        namespace_prefix: str,
        tp_rank: int = 0,
        l2: L2Store | None = None,
    ) -> None:
        self.settings = settings
        mac = l2_mac(settings) if l2 is not None else None
        self.writer = L2Writer(l2, settings.l2_write_queue_max, mac) if l2 is not None else None
        # The engine owns the namespace, the rank, the L2 store and its MAC (one copy of each).
        self.engine = TransferEngine(settings, namespace_prefix, tp_rank, l2, mac)
        self.cache = L1Cache(settings, self.engine)
        self.l1 = self.cache.index
        self.failures = FailedLoads()
        self.layer_index: dict[str, int] = {}
        self._step_load: LoadJob | None = None
        self._step_save: StoreJob | None = None
        self.stats = metrics.KVCacheStats()
        metrics.TIER_CAPACITY.labels("l1").set(settings.l1_capacity_bytes)
        self.lookahead = LookaheadPrefetcher(self.engine, self.cache)

    # -- setup ---------------------------------------------------------------------------
    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], num_blocks: int, block_size: int
    ) -> None:
        names = _layer_order(list(kv_caches))
        self.layer_index = {n: i for i, n in enumerate(names)}
        # Storage keys use global layer numbers: pipeline stages hold disjoint layers
        # whose local positions (0, 1, ...) would otherwise collide in a shared L2.
        self.engine.register([kv_caches[n] for n in names], num_blocks, block_size, _global_layer_ids(names))

    @property
    def slab(self) -> SlabPool | None:
        """L1's memory (the engine's; sized in register_kv_caches)."""
        return self.engine.slab

    def chunk_key(self, chunk_hash: str) -> str:
        return self.engine.chunk_key(chunk_hash)

    def _alloc_slot(self, key: str) -> int | None:
        slot = self.cache.alloc_slot(key)
        if slot is None:
            self.stats.add("l1_no_slot", 1)
        return slot

    def _check_chunk_blocks(self, meta: KVCacheStepMetadata) -> None:
        e = self.engine
        if meta.chunk_tokens and meta.chunk_tokens != e.chunk_blocks * e.block_size:
            raise ValueError(
                f"chunk_tokens {meta.chunk_tokens} != {e.chunk_blocks} x block size {e.block_size}"
            )

    # -- load ------------------------------------------------------------------------------
    def _load_job(self, items: list[ChunkTransfer]) -> LoadJob:
        """The step's load job: L1 chunks pinned (one slot reference each) for the step, so
        no save or eviction can reuse their memory while a copy may still read it; a slot
        for each L2 chunk to keep in L1."""
        t0 = time.perf_counter()
        l1_chunks: list[L1Chunk | None] = []
        promo_slots: list[int | None] = []
        for item in items:
            key = self.chunk_key(item.chunk_hash)
            chunk = self.cache.pin(key)
            l1_chunks.append(chunk)
            promo = self._alloc_slot(key) if chunk is None and self.engine.l2 is not None else None
            promo_slots.append(promo)
        return LoadJob(self.engine, items, l1_chunks, promo_slots, self.engine.corrupt(), t0)

    def start_load(self, meta: KVCacheStepMetadata) -> None:
        step = None
        if meta.loads and self.engine.kv:
            self._check_chunk_blocks(meta)
            step = self._step_load = self._load_job(meta.loads)
        # After the load job pinned its L1 chunks: a prefetch's slot may evict, never those.
        self.lookahead.submit(meta.prefetch)
        if step is None:
            return
        if self.settings.pipelined and (self.engine.cuda or step.uses_l2):
            step.submit(self.settings.prefetch_window or self.engine.n_layers)
        else:
            # Sync mode, or CPU with every chunk in L1: no copy engine and no I/O wait to
            # overlap with, so the copies run here, on the compute thread, before the
            # forward. (Interleaving them with the layers' compute measured ~20% slower
            # hits on one pinned core: docs/kvcache.md.)
            for layer in range(self.engine.n_layers):
                step.complete_layer(layer, host_wait=True, run_copies=False)
            step.run_host_copies()  # every layer's at once: the threads share out 8x the chunks
        step.blocked_s += time.perf_counter() - step.t0

    def wait_for_layer(self, layer_name: str) -> None:
        step = self._step_load
        if step is None or not self.settings.pipelined:
            return
        layer = self.layer_index.get(layer_name)
        if layer is not None:
            t0 = time.perf_counter()
            step.wait_layer(layer)
            step.blocked_s += time.perf_counter() - t0

    def finish_load(self) -> None:
        """Complete any load whose wait never came; then account and release."""
        step = self._step_load
        if step is None:
            return
        self._step_load = None
        step.finish()
        self._account_load(step)

    def _account_load(self, step: LoadJob) -> None:
        """Count the finished job's hits and misses, keep its L2 chunks in L1, release its
        slots and note its failed blocks (load errors; saves that read them are dropped)."""
        assert self.slab is not None
        bad: set[int] = set()
        failed_reqs: set[str] = set()
        loaded_tokens = 0
        for idx, item in enumerate(step.items):
            promo = step.promo_slots[idx]
            if step.failed[idx]:
                if promo is not None:
                    self.slab.unref(promo)
                bad.update(b for _, b in item.blocks)
                failed_reqs.add(item.req_id)
                self.cache.touch([item.chunk_hash])  # corrects the scheduler's view of L1
                reason = step.reasons[idx]
                metrics.MISSES.labels(reason).inc()
                self.stats.add(f"miss_{reason}", 1)
                if reason == "integrity":
                    metrics.INTEGRITY_FAILURES.inc()
                log_once(
                    reason,
                    "kvcache: chunk %s not loadable (%s); recomputing it (logged once per reason)",
                    item.chunk_hash,
                    reason,
                    logger=log,
                )
                continue
            tier = "l1" if step.l1_chunks[idx] is not None else "l2"
            metrics.HITS.labels(tier).inc()
            self.stats.add(f"hit_{tier}", 1)
            loaded_tokens += len(item.blocks)
            if promo is not None:
                # Keep the chunk loaded from L2 in L1, so the next hit is a memory copy.
                key = self.chunk_key(item.chunk_hash)
                if self.cache.keep(key, L1Chunk(promo, step.promo_sums[idx])):
                    self.cache.touch([item.chunk_hash])
                else:
                    self.slab.unref(promo)
        for chunk in step.l1_chunks:
            if chunk is not None:
                self.slab.unref(chunk.slot)
        self.failures.record(bad, failed_reqs)
        _count_load_sources(step, failed_reqs, self.stats)
        block_tokens = self.engine.block_size
        metrics.TOKENS_LOADED.inc(loaded_tokens * block_tokens)
        metrics.TIER_BYTES.labels("l1").set(self.l1.bytes_used)
        self.stats.add("tokens_loaded", loaded_tokens * block_tokens)
        metrics.LOAD_SECONDS.observe(step.blocked_s)
        self.stats.add("load_s", step.blocked_s)

    def take_load_errors(self) -> set[int]:
        self.finish_load()
        return self.failures.take_errors()

    # -- save ------------------------------------------------------------------------------
    def _store_job(self, items: list[ChunkTransfer]) -> StoreJob:
        """The step's store job: a slot per chunk (None when every slot is held); without a
        slot, a spill buffer when L2 still gets the chunk."""
        slots = [self._alloc_slot(self.chunk_key(item.chunk_hash)) for item in items]
        return StoreJob(self.engine, items, slots, spill=self.writer is not None)

    def save_layer(self, layer_name: str, meta: KVCacheStepMetadata) -> None:
        if not meta.saves or not self.settings.pipelined or not self.engine.cuda:
            return  # CPU: copied out at the barrier (wait_for_save), see the module docstring
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        step = self._step_save
        if step is None:
            self._check_chunk_blocks(meta)
            step = self._step_save = self._store_job(meta.saves)
        t0 = time.perf_counter()
        step.submit_layer(layer)
        step.blocked_s += time.perf_counter() - t0

    def wait_for_save(self, meta: KVCacheStepMetadata | None) -> None:
        """The one barrier of the save path: every copy-out of this step finishes here."""
        self.finish_load()
        step, self._step_save = self._step_save, None
        if meta is None or not meta.saves or not self.engine.kv:
            if step is not None:
                step.release_all()
            self.failures.end_step()
            return
        t0 = time.perf_counter()
        if step is None:
            self._check_chunk_blocks(meta)
            step = self._store_job(meta.saves)
        error = step.finish()
        if error is not None:
            self._drop_step_saves(step, error)
            spent = step.blocked_s + time.perf_counter() - t0
            metrics.SAVE_SECONDS.observe(spent)
            return
        poisoned = self._poisoned_saves(step)
        # Requests whose saves were dropped re-plan them (vLLM rewinds every request
        # holding a failed block, so they recompute those chunks).
        self.failures.end_step({step.items[i].req_id for i in poisoned})
        self._commit(step, poisoned)
        # Time the forward spent on this step's saves: layer copies issued in save_kv_layer
        # (CPU copies there run on the compute thread) plus this barrier.
        spent = step.blocked_s + time.perf_counter() - t0
        metrics.SAVE_SECONDS.observe(spent)
        self.stats.add("save_s", spent)

    def _poisoned_saves(self, step: StoreJob) -> set[int]:
        """Saves (indices) whose KV may come from a failed load (``FailedLoads.poisoned``).
        Counted; they are never stored."""
        out = self.failures.poisoned(step.items)
        if out:
            metrics.SAVES_DROPPED.labels("failed_load").inc(len(out))
            self.stats.add("saves_dropped_failed_load", len(out))
        return out

    def _drop_step_saves(self, step: StoreJob, error: BaseException) -> None:
        """A step whose copy-out failed stores nothing: its slots go back, and its requests
        re-plan their saves (as after a failed load)."""
        metrics.SAVE_ERRORS.inc()
        self.stats.add("save_errors", 1)
        log_once(
            "save-error", "kvcache: saving a step failed (%r); its chunks are not stored", error, logger=log
        )
        step.release_all()
        self.failures.end_step({item.req_id for item in step.items})

    def _commit(self, step: StoreJob, dropped: set[int]) -> None:
        assert self.slab is not None
        step.wait_copied()
        stored: set[str] = set()
        tokens = 0
        full = self.settings.l1_checksum == "full"
        for idx, item in enumerate(step.items):
            slot = step.slots[idx]
            if idx in dropped or not step.copied[idx]:
                if slot is not None:
                    self.slab.unref(slot)
                continue
            key = self.chunk_key(item.chunk_hash)
            layers = [step.target(idx, layer) for layer in range(self.engine.n_layers)]
            if slot is not None:
                sums = step.sums[idx]
                if self.writer is not None:
                    for _ in layers:  # queued L2 writes read the slot: hold it for them
                        self.slab.ref(slot)
                if self.cache.keep(key, L1Chunk(slot, sums)):  # the step's slot reference is L1's now
                    stored.add(item.chunk_hash)
                    metrics.BYTES_SAVED.labels("l1").inc(self.slab.slot_bytes)
                else:
                    self.slab.unref(slot)
                release = functools.partial(self.slab.unref, slot)
            else:
                sums, release = [None] * len(layers), None  # L2 only: no slot was free
            tokens += len(item.blocks) * self.engine.block_size
            if self.writer is not None:
                for layer, t in enumerate(layers):
                    crc = sums[layer] if full and slot is not None else None  # None: writer computes it
                    self.writer.submit(self.engine.storage_key(item.chunk_hash, layer), t, crc, release)
        metrics.TOKENS_SAVED.inc(tokens)
        metrics.TIER_BYTES.labels("l1").set(self.l1.bytes_used)
        self.stats.add("tokens_saved", tokens)
        self.cache.touch(stored)

    def take_report(self) -> KVCacheWorkerReport | None:
        """Where each chunk touched since the last report is now (L1 is the truth)."""
        self.lookahead.harvest()  # finished prefetches join L1 and this report
        touched = self.cache.take_touched()
        failed = self.failures.take_reqs()
        if not touched and not failed:
            return None
        report = KVCacheWorkerReport(failed_reqs=failed)
        for h in touched:
            (report.stored if self.chunk_key(h) in self.l1 else report.evicted).add(h)
        return report

    def take_stats(self) -> metrics.KVCacheStats | None:
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, metrics.KVCacheStats()
        return stats

    def shutdown(self) -> None:
        self.lookahead.close()
        self.engine.shutdown()
        if self.writer is not None:
            self.writer.close()
        if self.engine.l2 is not None:
            self.engine.l2.close()


def _count_load_sources(step: LoadJob, failed_reqs: set[str], stats: metrics.KVCacheStats) -> None:
    """Per request loaded this step: was all of its KV in L1 when it was scheduled, or did some
    come from L2 (what lookahead prefetch is for: docs/kvcache.md)."""
    from_l2: dict[str, bool] = {}
    for idx, item in enumerate(step.items):
        if not step.failed[idx]:
            from_l2[item.req_id] = from_l2.get(item.req_id, False) or step.l1_chunks[idx] is None
    for req_id, any_l2 in from_l2.items():
        if req_id not in failed_reqs:
            metrics.LOAD_REQUESTS.labels("l2" if any_l2 else "l1").inc()
            stats.add("load_requests_l2" if any_l2 else "load_requests_l1", 1)
