"""Worker side: moves KV bytes between vLLM's paged cache and the tiers.

L1 is a slab of preallocated host memory (``tiers/slab.py``): a save copies a chunk's
blocks straight into a free slot, a load copies them back; runs of consecutive blocks move
as one slice copy, so a prompt's chunks usually cost one copy per layer each way.

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
copy-outs in ``wait_for_save``. Both modes share every line of the data path below.

With the full L1 check on CPU (the default), each chunk is copied and then hashed while its
bytes are still in the CPU's caches, and a step's chunks of every layer are shared out over
the cores the worker may use (``host_copy``; one core: inline).

A chunk that cannot be loaded (absent, unreachable tier, key/layout/checksum mismatch)
has its blocks reported through ``take_load_errors`` so vLLM recomputes them.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvcache import codec, metrics
from kvcache.config import KVCacheSettings
from kvcache.host_copy import ChunkCopier, ChunkCopy, chunk_copy, host_array, host_threads
from kvcache.keys import layer_number, storage_key
from kvcache.metadata import ChunkTransfer, KVCacheStepMetadata, KVCacheWorkerReport
from kvcache.secrets import l2_mac
from kvcache.tiers import L1Pool, L2Store, RecordRefused, TierUnavailable
from kvcache.tiers.slab import SlabPool
from kvcache.tiers.writer import L2Writer
from kvcache.transfer import CudaCopier, HostCopier, Move, PagedLayout, make_copier

# Under "vllm." so that records reach the handlers vLLM configures in its processes.
log = logging.getLogger(f"vllm.{__name__}")


@dataclass
class L1Chunk:
    """One chunk in L1: a slab slot (every layer's blocks) and a check value per layer."""

    slot: int
    sums: list[int | None]  # per layer, by l1_checksum: fingerprint, crc32, or None (off)


class _LoadFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


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
        self.ns = namespace_prefix
        self.tp_rank = tp_rank
        self.l1: L1Pool[L1Chunk] = L1Pool(
            settings.l1_capacity_bytes, settings.l1_eviction, on_drop=self._l1_dropped
        )
        self.slab: SlabPool | None = None  # sized in register_kv_caches
        self.l2 = l2
        self.mac = l2_mac(settings) if l2 is not None else None
        self.writer = L2Writer(l2, settings.l2_write_queue_max, self.mac) if l2 is not None else None
        self._io = ThreadPoolExecutor(settings.io_threads, thread_name_prefix="kvcache-load")
        # One saver thread keeps CUDA copy-outs in layer order.
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvcache-save")
        self.kv: list[torch.Tensor] = []
        self.block_size = 0
        self.chunk_blocks = 0
        self.layer_index: dict[str, int] = {}
        self.layer_ids: list[int] = []
        self.layout: PagedLayout | None = None
        self.copier: HostCopier | None = None
        self._chunk_copier: ChunkCopier | None = None  # CPU with the full L1 check
        self._kv_arrays: list[np.ndarray] = []  # and the paged layers as numpy byte views
        self.cuda = False
        self._touched: set[str] = set()  # chunk hashes put into / evicted from L1
        # Requests whose load failed this step: the KV they computed this step attended
        # to blocks that were not loaded, so none of it may be saved.
        self._step_failed_reqs: set[str] = set()
        # Block ids whose load failed this step. With vLLM's prefix caching another request
        # may share those very blocks (or attend to them) in the same step, so saves are
        # invalidated by block, not only by the request whose load failed.
        self._step_failed_blocks: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._report_lock = threading.Lock()
        self._errors: set[int] = set()
        self._errors_lock = threading.Lock()
        self._step_load: _StepLoad | None = None
        self._step_save: _StepSave | None = None
        self.stats = metrics.KVCacheStats()
        metrics.TIER_CAPACITY.labels("l1").set(settings.l1_capacity_bytes)

    # -- setup ---------------------------------------------------------------------------
    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], num_blocks: int, block_size: int
    ) -> None:
        self.block_size = block_size
        self.chunk_blocks = self.settings.chunk_size(block_size) // block_size
        names = _layer_order(list(kv_caches))
        self.layer_index = {n: i for i, n in enumerate(names)}
        # Storage keys use global layer numbers: pipeline stages hold disjoint layers
        # whose local positions (0, 1, ...) would otherwise collide in a shared L2.
        self.layer_ids = _global_layer_ids(names)
        self.kv = [kv_caches[n] for n in names]
        self.layout = PagedLayout.detect(self.kv[0], num_blocks)
        self.copier = make_copier(self.layout.device)
        self.cuda = isinstance(self.copier, CudaCopier)
        if self._hash_per_chunk():
            self._chunk_copier = ChunkCopier(host_threads())
            self._kv_arrays = [np.moveaxis(host_array(t), self.layout.block_dim, 0) for t in self.kv]
        self.slab = SlabPool(
            self.settings.l1_capacity_bytes,
            len(self.kv),
            self.chunk_blocks,
            self.layout.block_shape,
            self.layout.dtype,
            pin_memory=self.copier.pinned,
        )
        log.info(
            "kvcache: %d layers, layout %s, mode %s, L1 %d slots of %d bytes, L1 check %s%s",
            len(self.kv),
            self.layout.describe(),
            self.settings.mode,
            self.slab.max_slots,
            self.slab.slot_bytes,
            self.settings.l1_checksum,
            f" ({self._chunk_copier.threads} copy threads)" if self._chunk_copier else "",
        )

    def chunk_key(self, chunk_hash: str) -> str:
        return f"kv:{self.ns}:r{self.tp_rank}:{chunk_hash}"

    # -- L1 slots --------------------------------------------------------------------------
    def _l1_dropped(self, key: str, chunk: L1Chunk) -> None:
        assert self.slab is not None
        self.slab.unref(chunk.slot)

    def _alloc_slot(self, key: str) -> int | None:
        """A slot for a new chunk, evicting from L1 when every slot is taken (None: all
        remaining slots are held by loads or queued L2 writes)."""
        assert self.slab is not None
        slot = self.slab.alloc(key)
        while slot is None:
            gone = self.l1.evict_one()
            if gone is None:
                break
            self._note_evicted([gone])
            slot = self.slab.alloc(key)
        if slot is None:
            self.stats.add("l1_no_slot", 1)
        return slot

    def _note_evicted(self, keys: list[str]) -> None:
        if not keys:
            return
        metrics.EVICTIONS.labels("l1").inc(len(keys))
        with self._report_lock:
            self._touched.update(k.rsplit(":", 1)[1] for k in keys)

    def _sum(self, view: torch.Tensor) -> int | None:
        mode = self.settings.l1_checksum
        if mode == "sampled":
            return codec.fingerprint(view)
        if mode == "full":
            return codec.checksum(view)
        return None

    def _layer_sums(self, layer: int, slots: list[int]) -> list[int | None]:
        """Check values of one layer of many slots; consecutive slots share one sampling op."""
        assert self.slab is not None
        mode = self.settings.l1_checksum
        if mode != "sampled":
            return [self._sum(self.slab.view(s, layer)) for s in slots]
        out: dict[int, int] = {}
        order = sorted(set(slots))
        i = 0
        while i < len(order):
            j = i + 1
            seg = self.slab.segment_of(order[i])
            while j < len(order) and order[j] == order[j - 1] + 1 and self.slab.segment_of(order[j]) == seg:
                j += 1
            base, row0 = self.slab.rows(order[i], layer)
            run = base.narrow(0, row0, (j - i) * self.chunk_blocks).view(j - i, -1)
            out.update(zip(order[i:j], codec.fingerprints(run), strict=True))
            i = j
        return [out[s] for s in slots]

    def _check_chunk_blocks(self, meta: KVCacheStepMetadata) -> None:
        if meta.chunk_tokens and meta.chunk_tokens != self.chunk_blocks * self.block_size:
            raise ValueError(
                f"chunk_tokens {meta.chunk_tokens} != {self.chunk_blocks} x block size {self.block_size}"
            )

    # -- load ------------------------------------------------------------------------------
    def start_load(self, meta: KVCacheStepMetadata) -> None:
        if not meta.loads or not self.kv:
            return
        self._check_chunk_blocks(meta)
        step = _StepLoad(self, meta.loads)
        self._step_load = step
        if self.settings.pipelined and (self.cuda or step.uses_l2):
            step.submit_upto(self.settings.prefetch_window or len(self.kv))
        else:
            # Sync mode, or CPU with every chunk in L1: no copy engine and no I/O wait to
            # overlap with, so the copies run here, on the compute thread, before the
            # forward. (Interleaving them with the layers' compute measured ~20% slower
            # hits on one pinned core: docs/kvcache.md.)
            for layer in range(len(self.kv)):
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

    def _prepare_layer(self, step: _StepLoad, layer: int) -> None:
        """Fetch, check and stage one layer of the step's L2 chunks (L1 chunks need nothing)."""
        for idx, item in enumerate(step.items):
            if step.failed[idx] or step.l1_chunks[idx] is not None:
                continue
            try:
                step.sources[idx][layer] = self._fetch_l2(step, idx, item, layer)
            except _LoadFailed as exc:
                step.fail(idx, exc.reason)
            except Exception as exc:  # nothing a tier returns may raise into the forward
                _log_once(
                    "load-error", "kvcache: load of chunk %s failed: %r; recomputing it", item.chunk_hash, exc
                )
                step.fail(idx, "integrity")

    def _fetch_l2(self, step: _StepLoad, idx: int, item: ChunkTransfer, layer: int) -> torch.Tensor:
        assert self.layout is not None and self.slab is not None
        if self.l2 is None:
            raise _LoadFailed("absent")
        key = storage_key(self.ns, self.tp_rank, item.chunk_hash, self.layer_ids[layer])
        expected = codec.Expected(key, self.layout.dtype, self.layout.chunk_shape(self.chunk_blocks))
        try:
            record = self.l2.get(key, max_bytes=codec.max_record_bytes(expected_nbytes(expected)))
        except TierUnavailable as exc:
            metrics.L2_ERRORS.labels("get").inc()
            raise _LoadFailed("unavailable") from exc
        except RecordRefused as exc:
            _log_once("record-refused", "kvcache: %s; counted as a miss", exc)
            raise _LoadFailed("integrity") from exc
        if record is None:
            raise _LoadFailed("absent")
        if not isinstance(record, (bytes, bytearray, memoryview)):
            raise _LoadFailed("integrity")
        if step.corrupt:
            head = len(record) - expected_nbytes(expected)
            record = record[:head] + bytes(len(record) - head)
        try:
            src, crc = codec.decode(record, expected, self.settings.verify_checksum, self.mac)
        except codec.IntegrityError as exc:
            raise _LoadFailed("integrity") from exc
        metrics.BYTES_LOADED.labels(self.l2.name).inc(len(record))
        slot = step.promo_slots[idx]
        if slot is None:
            return src
        # Stage in the slot that keeps this chunk in L1 afterwards (the next hit is a copy).
        view = self.slab.view(slot, layer)
        view.copy_(src)
        step.promo_sums[idx][layer] = crc if self.settings.l1_checksum == "full" else self._sum(view)
        return view

    def _hash_per_chunk(self) -> bool:
        """Full L1 checks on CPU run chunk by chunk, each right after that chunk's copy, so
        the hash reads bytes the copy just brought into the CPU's caches, and the chunks
        are shared out over the worker's cores (``host_copy``)."""
        return not self.cuda and self.settings.l1_checksum == "full"

    def _chunk_copy(self, slot: int, layer: int, item: ChunkTransfer, into_kv: bool) -> ChunkCopy:
        assert self.slab is not None and self._kv_arrays
        rows, row0 = self.slab.row_bytes(slot, layer)
        return chunk_copy(self._kv_arrays[layer], rows, row0, item.blocks, self.chunk_blocks, into_kv)

    def _check_l1(self, step: _StepLoad, layer: int, sums_later: bool) -> dict[int, torch.Tensor]:
        """Check this layer of the step's L1 chunks; failures are marked. Returns, under the
        test-only fault injection, the zeros that replace each chunk's bytes. With
        ``sums_later`` the checksums are left to ``_scatter_layer``, chunk by chunk."""
        assert self.slab is not None
        checked: dict[int, L1Chunk] = {}
        for idx, chunk in enumerate(step.l1_chunks):
            if chunk is None or step.failed[idx]:
                continue
            if self.slab.owner(chunk.slot) != self.chunk_key(step.items[idx].chunk_hash):
                step.fail(idx, "integrity")  # the slot no longer holds this chunk
                continue
            checked[idx] = chunk
        replaced: dict[int, torch.Tensor] = {}
        if step.corrupt:
            replaced = {i: torch.zeros_like(self.slab.view(c.slot, layer)) for i, c in checked.items()}
        if sums_later or not self.settings.verify_checksum or self.settings.l1_checksum == "off":
            return replaced
        if step.corrupt:
            got = [self._sum(replaced[i]) for i in checked]
        else:
            got = self._layer_sums(layer, [c.slot for c in checked.values()])
        for (idx, chunk), value in zip(checked.items(), got, strict=True):
            expected = chunk.sums[layer]
            if expected is not None and value != expected:
                step.fail(idx, "integrity")
        return replaced

    def _scatter_layer(self, step: _StepLoad, layer: int) -> object:
        """Copy one layer of every loadable chunk into the paged cache; failed chunks are
        marked, not raised. Returns the CUDA event of the last copy.

        A chunk that fails its check is not copied, except under the CPU full check, which
        hashes each L1 chunk right after copying it (its bytes are then in the caches): a
        failed chunk's blocks then hold the bad bytes instead of whatever they held before.
        Either way they are unusable until recomputed, and they are reported as failed
        (vLLM recomputes them; saves that read them are dropped)."""
        assert self.layout is not None and self.copier is not None and self.slab is not None
        kv = self.kv[layer]
        # The test-only fault hook replaces the bytes before the check: it keeps the batched path.
        per_chunk = self._hash_per_chunk() and self.settings.verify_checksum and not step.corrupt
        replaced = self._check_l1(step, layer, sums_later=per_chunk)
        moves: list[Move] = []
        last_event = None
        for idx, item in enumerate(step.items):
            if step.failed[idx]:
                continue
            chunk = step.l1_chunks[idx]
            if per_chunk and chunk is not None:
                step.host_copies.append((idx, layer, self._chunk_copy(chunk.slot, layer, item, into_kv=True)))
                continue
            slot = chunk.slot if chunk is not None else step.promo_slots[idx]
            if idx in replaced:
                base, row0 = replaced[idx], 0
            elif slot is not None:
                base, row0 = self.slab.rows(slot, layer)
            else:
                src = step.sources[idx][layer]
                if src is None:  # not fetched (its chunk failed on another layer)
                    continue
                base, row0 = src, 0
            if self.cuda:
                rows = [row0 + i for i, _ in item.blocks]
                consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
                src = base.narrow(0, rows[0], len(rows)) if consecutive else base[rows]
                last_event = self.copier.scatter_async(  # type: ignore[attr-defined]
                    kv, self.layout, [b for _, b in item.blocks], src, step.compute_ready
                )
            else:
                moves.extend((base, row0 + i, b) for i, b in item.blocks)
        if moves:
            self.copier.scatter_rows(kv, self.layout, moves)
        return last_event

    def _load_layer_cuda(self, step: _StepLoad, layer: int) -> object:
        self._prepare_layer(step, layer)
        return self._scatter_layer(step, layer)

    def _corrupt(self) -> bool:
        path = self.settings.fault_injection_file
        if not path or not os.path.exists(path):
            return False
        try:
            with open(path) as f:
                return f.read().strip() == "zeros"
        except OSError:
            return False

    def take_load_errors(self) -> set[int]:
        self.finish_load()
        with self._errors_lock:
            out, self._errors = self._errors, set()
        return out

    # -- save ------------------------------------------------------------------------------
    def save_layer(self, layer_name: str, meta: KVCacheStepMetadata) -> None:
        if not meta.saves or not self.settings.pipelined or not self.cuda:
            return  # CPU: copied out at the barrier (wait_for_save), see the module docstring
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        step = self._step_save
        if step is None:
            self._check_chunk_blocks(meta)
            step = self._step_save = _StepSave(self, meta.saves)
        assert self.copier is not None
        t0 = time.perf_counter()
        ready = self.copier.mark_compute()
        step.futures[layer] = self._saver.submit(self._gather_layer, step, layer, ready)
        step.issued[layer] = True
        step.blocked_s += time.perf_counter() - t0

    def wait_for_save(self, meta: KVCacheStepMetadata | None) -> None:
        """The one barrier of the save path: every copy-out of this step finishes here."""
        self.finish_load()
        step, self._step_save = self._step_save, None
        if meta is None or not meta.saves or not self.kv:
            if step is not None:
                step.release_all()
            with self._report_lock:
                self._failed_reqs |= self._step_failed_reqs
            self._step_failed_reqs = set()
            self._step_failed_blocks = set()
            return
        t0 = time.perf_counter()
        if step is None:
            self._check_chunk_blocks(meta)
            step = _StepSave(self, meta.saves)
        ready = None
        error: BaseException | None = None
        for layer in range(len(self.kv)):
            fut = step.futures[layer]
            try:
                if fut is not None:
                    fut.result()
                elif not step.issued[layer] and error is None:
                    # Sync mode (or a layer whose save hook never ran): copy it out now.
                    if ready is None and self.copier is not None:
                        ready = self.copier.mark_compute()
                    self._gather_layer(step, layer, ready)
            except Exception as exc:  # a failed copy-out is a skipped save, never an engine error
                error = error or exc
        if error is None:
            try:
                step.run_host_copies()
            except Exception as exc:
                error = exc
        if error is not None:
            self._drop_step_saves(step, error)
            spent = step.blocked_s + time.perf_counter() - t0
            metrics.SAVE_SECONDS.observe(spent)
            return
        failed, self._step_failed_reqs = self._step_failed_reqs, set()
        bad_blocks, self._step_failed_blocks = self._step_failed_blocks, set()
        poisoned = self._poisoned_saves(step, failed, bad_blocks)
        with self._report_lock:
            # Requests whose saves were dropped re-plan them (vLLM rewinds every request
            # holding a failed block, so they recompute those chunks).
            self._failed_reqs |= failed | {step.items[i].req_id for i in poisoned}
        self._commit(step, poisoned)
        # Time the forward spent on this step's saves: layer copies issued in save_kv_layer
        # (CPU copies there run on the compute thread) plus this barrier.
        spent = step.blocked_s + time.perf_counter() - t0
        metrics.SAVE_SECONDS.observe(spent)
        self.stats.add("save_s", spent)

    def _poisoned_saves(self, step: _StepSave, failed_reqs: set[str], bad_blocks: set[int]) -> set[int]:
        """Saves (indices) whose KV may come from a failed load: the chunk's own blocks were
        to be loaded, or its request attended to such blocks (``deps``), or it is a request
        whose load failed. Counted; they are never stored."""
        out: set[int] = set()
        for idx, item in enumerate(step.items):
            if item.req_id in failed_reqs or (
                bad_blocks
                and (any(b in bad_blocks for _, b in item.blocks) or any(b in bad_blocks for b in item.deps))
            ):
                out.add(idx)
        if out:
            metrics.SAVES_DROPPED.labels("failed_load").inc(len(out))
            self.stats.add("saves_dropped_failed_load", len(out))
        return out

    def _drop_step_saves(self, step: _StepSave, error: BaseException) -> None:
        """A step whose copy-out failed stores nothing: its slots go back, and its requests
        re-plan their saves (as after a failed load)."""
        metrics.SAVE_ERRORS.inc()
        self.stats.add("save_errors", 1)
        _log_once("save-error", "kvcache: saving a step failed (%r); its chunks are not stored", error)
        step.release_all()
        failed, self._step_failed_reqs = self._step_failed_reqs, set()
        self._step_failed_blocks = set()
        with self._report_lock:
            self._failed_reqs |= failed | {item.req_id for item in step.items}

    def _gather_layer(self, step: _StepSave, layer: int, ready: object) -> None:
        assert self.layout is not None and self.copier is not None and self.slab is not None
        kv = self.kv[layer]
        if self.cuda:
            for idx, item in enumerate(step.items):
                if not step.copied[idx]:
                    continue
                dst = step.target(idx, layer).narrow(0, 0, len(item.blocks))
                step.events[layer] = self.copier.gather_async(  # type: ignore[attr-defined]
                    kv, self.layout, [b for _, b in item.blocks], ready, dst
                )
            return
        per_chunk = self._hash_per_chunk()
        moves: list[Move] = []
        for idx, item in enumerate(step.items):
            slot = step.slots[idx]
            if not step.copied[idx]:
                continue
            if slot is not None:
                base, row0 = self.slab.rows(slot, layer)
            else:
                base, row0 = step.target(idx, layer), 0
            if per_chunk and slot is not None:
                step.host_copies.append((idx, layer, self._chunk_copy(slot, layer, item, into_kv=False)))
            else:
                moves.extend((base, row0 + i, b) for i, b in item.blocks)
        self.copier.gather_rows(kv, self.layout, moves)
        if per_chunk:
            return  # the slots' copies and check values: _StepSave.run_host_copies
        held = {idx: slot for idx, slot in enumerate(step.slots) if slot is not None}
        for idx, value in zip(held, self._layer_sums(layer, list(held.values())), strict=True):
            step.sums[idx][layer] = value

    def _commit(self, step: _StepSave, dropped: set[int]) -> None:
        assert self.slab is not None and self.copier is not None
        if self.cuda:
            for ev in step.events:
                self.copier.wait_host(ev)
            # Copied by DMA: check values from the host copies, now complete (one batched
            # sampling op per layer and run of slots).
            held = {idx: slot for idx, slot in enumerate(step.slots) if slot is not None}
            for layer in range(len(self.kv)):
                for idx, value in zip(held, self._layer_sums(layer, list(held.values())), strict=True):
                    step.sums[idx][layer] = value
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
            layers = [step.target(idx, layer) for layer in range(len(self.kv))]
            if slot is not None:
                sums = step.sums[idx]
                if self.writer is not None:
                    for _ in layers:  # queued L2 writes read the slot: hold it for them
                        self.slab.ref(slot)
                self._note_evicted(self.l1.put(key, L1Chunk(slot, sums), self.slab.slot_bytes))
                if key in self.l1:  # the step's reference now belongs to L1's index
                    stored.add(item.chunk_hash)
                    metrics.BYTES_SAVED.labels("l1").inc(self.slab.slot_bytes)
                else:
                    self.slab.unref(slot)
                release = functools.partial(self.slab.unref, slot)
            else:
                sums, release = [None] * len(layers), None  # L2 only: no slot was free
            tokens += len(item.blocks) * self.block_size
            if self.writer is not None:
                for layer, t in enumerate(layers):
                    crc = sums[layer] if full and slot is not None else None  # None: writer computes it
                    self.writer.submit(
                        storage_key(self.ns, self.tp_rank, item.chunk_hash, self.layer_ids[layer]),
                        t,
                        crc,
                        release,
                    )
        metrics.TOKENS_SAVED.inc(tokens)
        metrics.TIER_BYTES.labels("l1").set(self.l1.bytes_used)
        self.stats.add("tokens_saved", tokens)
        with self._report_lock:
            self._touched |= stored

    def take_report(self) -> KVCacheWorkerReport | None:
        """Where each chunk touched since the last report is now (L1 is the truth)."""
        with self._report_lock:
            touched, self._touched = self._touched, set()
            failed, self._failed_reqs = self._failed_reqs, set()
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
        self._io.shutdown(wait=True)
        self._saver.shutdown(wait=True)
        if self._chunk_copier is not None:
            self._chunk_copier.shutdown()
        if self.writer is not None:
            self.writer.close()
        if self.l2 is not None:
            self.l2.close()


def expected_nbytes(expected: codec.Expected) -> int:
    n = 1
    for s in expected.shape:
        n *= s
    return n * torch.empty((), dtype=expected.dtype).element_size()


class _StepSave:
    """The saves of one engine step: a slot (or, when none is free, a spill buffer for the
    L2 write only) per chunk, and per-layer copy state."""

    def __init__(self, worker: KVCacheWorker, items: list[ChunkTransfer]) -> None:
        assert worker.slab is not None and worker.layout is not None and worker.copier is not None
        self.worker = worker
        self.items = items
        n_layers = len(worker.kv)
        self.slots: list[int | None] = []
        self.spill: list[torch.Tensor | None] = []
        for item in items:
            slot = worker._alloc_slot(worker.chunk_key(item.chunk_hash))
            self.slots.append(slot)
            spill = None
            if slot is None and worker.writer is not None:
                with torch.inference_mode(False):  # written by the save thread on CUDA
                    spill = torch.empty(
                        (n_layers, *worker.layout.chunk_shape(worker.chunk_blocks)),
                        dtype=worker.layout.dtype,
                        pin_memory=worker.copier.pinned,
                    )
            self.spill.append(spill)
        # Chunks with neither a slot nor an L2 to write to are not copied at all.
        self.copied = [
            slot is not None or sp is not None for slot, sp in zip(self.slots, self.spill, strict=True)
        ]
        self.sums: list[list[int | None]] = [[None] * n_layers for _ in items]
        self.futures: list[Future | None] = [None] * n_layers
        self.events: list[object] = [None] * n_layers
        self.issued = [False] * n_layers
        self.blocked_s = 0.0  # compute-thread time in save_kv_layer calls
        # CPU full check: (chunk, layer, copy into its slot), run for all layers at once.
        self.host_copies: list[tuple[int, int, ChunkCopy]] = []

    def run_host_copies(self) -> None:
        pending, self.host_copies = self.host_copies, []
        if not pending:
            return
        assert self.worker._chunk_copier is not None
        values = self.worker._chunk_copier.run([c for _, _, c in pending])
        for (idx, layer, _), value in zip(pending, values, strict=True):
            self.sums[idx][layer] = value

    def target(self, idx: int, layer: int) -> torch.Tensor:
        slot = self.slots[idx]
        if slot is not None:
            return self.worker.slab.view(slot, layer)  # type: ignore[union-attr]
        return self.spill[idx][layer]  # type: ignore[index]

    def release_all(self) -> None:
        """Wait for every copy of the step (failed ones included), then free its slots."""
        for fut in self.futures:
            if fut is not None:
                try:
                    fut.result()
                except Exception:  # the step is being dropped: its slots must still go back
                    pass
        for ev in self.events:
            try:
                self.worker.copier.wait_host(ev)  # type: ignore[union-attr]
            except Exception:
                pass
        for slot in self.slots:
            if slot is not None:
                self.worker.slab.unref(slot)  # type: ignore[union-attr]


class _StepLoad:
    """The loads of one engine step: per-layer progress and per-chunk outcome.

    L1 chunks are pinned (one slot reference each) for the step, so no save or eviction
    can reuse their memory while a copy may still read it.
    """

    def __init__(self, worker: KVCacheWorker, items: list[ChunkTransfer]) -> None:
        assert worker.slab is not None
        self.worker = worker
        self.items = items
        self.t0 = time.perf_counter()
        n_layers = len(worker.kv)
        slab = worker.slab
        self.l1_chunks: list[L1Chunk | None] = []
        self.promo_slots: list[int | None] = []
        for item in items:
            key = worker.chunk_key(item.chunk_hash)
            chunk = worker.l1.get(key, on_hit=lambda c: slab.ref(c.slot))
            self.l1_chunks.append(chunk)
            promo = worker._alloc_slot(key) if chunk is None and worker.l2 is not None else None
            self.promo_slots.append(promo)
        self.uses_l2 = any(c is None for c in self.l1_chunks) and worker.l2 is not None
        self.corrupt = worker._corrupt()
        self.failed = [False] * len(items)
        self.reasons: list[str] = [""] * len(items)
        self.sources: list[list[torch.Tensor | None]] = [[None] * n_layers for _ in items]
        self.promo_sums: list[list[int | None]] = [[None] * n_layers for _ in items]
        self.futures: list[Future | None] = [None] * n_layers
        self.events: list[object] = [None] * n_layers
        self.done = [False] * n_layers
        self.next_submit = 0
        self.compute_ready = worker.copier.mark_compute() if worker.copier else None
        # CPU full check: (chunk, layer, copy out of its L1 slot), checked once copied.
        self.host_copies: list[tuple[int, int, ChunkCopy]] = []
        self._lock = threading.Lock()
        # Compute-thread time spent on this step's loads (start_load_kv, the per-layer
        # waits, and completing at the barrier): what loading costs the forward.
        self.blocked_s = 0.0

    def fail(self, idx: int, reason: str) -> None:
        with self._lock:
            if not self.failed[idx]:
                self.failed[idx] = True
                self.reasons[idx] = reason

    def submit_upto(self, count: int) -> None:
        """Start background work for layers below ``count``: the whole load on CUDA (side
        stream), only L2 fetches on CPU (L1 copies run on the compute thread)."""
        w = self.worker
        while self.next_submit < min(count, len(self.futures)):
            layer = self.next_submit
            if w.cuda:
                self.futures[layer] = w._io.submit(w._load_layer_cuda, self, layer)
            elif self.uses_l2:
                self.futures[layer] = w._io.submit(w._prepare_layer, self, layer)
            self.next_submit += 1

    def run_host_copies(self) -> None:
        """Run the queued L1 copies and fail every chunk whose bytes do not match."""
        pending, self.host_copies = self.host_copies, []
        if not pending:
            return
        assert self.worker._chunk_copier is not None
        values = self.worker._chunk_copier.run([c for _, _, c in pending])
        for (idx, layer, _), value in zip(pending, values, strict=True):
            expected = self.l1_chunks[idx].sums[layer]  # type: ignore[union-attr]
            if expected is not None and value != expected:
                self.fail(idx, "integrity")

    def complete_layer(self, layer: int, host_wait: bool, run_copies: bool = True) -> None:
        """Make ``layer``'s load complete (CPU) or ordered before compute (CUDA); with
        ``run_copies`` False the CPU's L1 copies wait for ``run_host_copies``."""
        if self.done[layer]:
            return
        w = self.worker
        fut = self.futures[layer]
        if w.cuda:
            ev = fut.result() if fut is not None else w._load_layer_cuda(self, layer)
            self.events[layer] = ev
            (w.copier.wait_host if host_wait else w.copier.wait_device)(ev)  # type: ignore[union-attr]
        else:
            if fut is not None:
                fut.result()
            else:
                w._prepare_layer(self, layer)
            w._scatter_layer(self, layer)
            if run_copies:
                self.run_host_copies()
        self.done[layer] = True

    def wait_layer(self, layer: int) -> None:
        window = self.worker.settings.prefetch_window or len(self.futures)
        self.submit_upto(layer + 1)
        self.complete_layer(layer, host_wait=False)
        self.submit_upto(layer + 1 + window)

    def finish(self) -> None:
        w = self.worker
        assert w.slab is not None
        t0 = time.perf_counter()
        for layer in range(len(self.futures)):
            self.complete_layer(layer, host_wait=True, run_copies=False)
        self.run_host_copies()
        for ev in self.events:  # copies may still read pinned slots: done before release
            w.copier.wait_host(ev)  # type: ignore[union-attr]
        self.blocked_s += time.perf_counter() - t0
        bad: set[int] = set()
        failed_reqs: set[str] = set()
        loaded_tokens = 0
        for idx, item in enumerate(self.items):
            promo = self.promo_slots[idx]
            if self.failed[idx]:
                if promo is not None:
                    w.slab.unref(promo)
                bad.update(b for _, b in item.blocks)
                failed_reqs.add(item.req_id)
                with w._report_lock:
                    w._touched.add(item.chunk_hash)  # corrects the scheduler's view of L1
                reason = self.reasons[idx]
                metrics.MISSES.labels(reason).inc()
                w.stats.add(f"miss_{reason}", 1)
                if reason == "integrity":
                    metrics.INTEGRITY_FAILURES.inc()
                _log_once(
                    reason,
                    "kvcache: chunk %s not loadable (%s); recomputing it (logged once per reason)",
                    item.chunk_hash,
                    reason,
                )
                continue
            tier = "l1" if self.l1_chunks[idx] is not None else "l2"
            metrics.HITS.labels(tier).inc()
            w.stats.add(f"hit_{tier}", 1)
            loaded_tokens += len(item.blocks)
            if promo is not None:
                # Keep the chunk loaded from L2 in L1, so the next hit is a memory copy.
                key = w.chunk_key(item.chunk_hash)
                w._note_evicted(w.l1.put(key, L1Chunk(promo, self.promo_sums[idx]), w.slab.slot_bytes))
                if key in w.l1:
                    with w._report_lock:
                        w._touched.add(item.chunk_hash)
                else:
                    w.slab.unref(promo)
        for chunk in self.l1_chunks:
            if chunk is not None:
                w.slab.unref(chunk.slot)
        if bad:
            with w._errors_lock:
                w._errors |= bad
        w._step_failed_reqs = failed_reqs
        w._step_failed_blocks = bad
        block_tokens = w.block_size
        metrics.TOKENS_LOADED.inc(loaded_tokens * block_tokens)
        metrics.TIER_BYTES.labels("l1").set(w.l1.bytes_used)
        w.stats.add("tokens_loaded", loaded_tokens * block_tokens)
        metrics.LOAD_SECONDS.observe(self.blocked_s)
        w.stats.add("load_s", self.blocked_s)


_logged: set[str] = set()


def _log_once(tag: str, msg: str, *args: object) -> None:
    if tag not in _logged:
        _logged.add(tag)
        log.warning(msg, *args)
