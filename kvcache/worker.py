"""Worker side: moves KV bytes between vLLM's paged cache and the tiers.

Pipelined mode (default):
- ``start_load`` queues every layer's load, in layer order, up to ``prefetch_window``
  layers ahead; ``wait_for_layer`` waits for that one layer (on CUDA: the compute stream
  waits on an event, the host does not block).
- ``save_layer`` queues the copy-out of that layer and returns; ``wait_for_save`` is the
  only barrier. Finished chunks go to L1 at once and to L2 through the write-behind queue.
Sync mode does the same work with no overlap: all loads before the forward, all
copy-outs in ``wait_for_save``. Both modes share every line of the data path below.

A chunk that cannot be loaded (absent, unreachable tier, key/layout/checksum mismatch)
has its blocks reported through ``take_load_errors`` so vLLM recomputes them.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvcache import codec, metrics
from kvcache.config import KVCacheSettings
from kvcache.keys import storage_key
from kvcache.metadata import ChunkTransfer, KVCacheStepMetadata, KVCacheWorkerReport
from kvcache.tiers import L1Pool, L2Store, TierUnavailable
from kvcache.tiers.writer import L2Writer
from kvcache.transfer import CudaCopier, PagedLayout, make_copier

# Under "vllm." so that records reach the handlers vLLM configures in its processes.
log = logging.getLogger(f"vllm.{__name__}")


@dataclass
class StoredChunk:
    """One chunk in L1: a host tensor per layer plus each tensor's crc32."""

    layers: list[torch.Tensor]
    crcs: list[int | None]  # None: not checksummed in L1 (l1_checksum off)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)


class _LoadFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _layer_order(names: list[str]) -> list[str]:
    """Layer names sorted by their layer number (vLLM names: model.layers.<n>.self_attn.attn)."""

    def num(name: str) -> tuple[int, str]:
        found = re.findall(r"\.(\d+)\.", f".{name}.")
        return (int(found[0]) if found else 0, name)

    return sorted(names, key=num)


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
        self.l1: L1Pool[StoredChunk] = L1Pool(settings.l1_capacity_bytes, settings.l1_eviction)
        self.l2 = l2
        self.writer = L2Writer(l2, settings.l2_write_queue_max) if l2 is not None else None
        self._io = ThreadPoolExecutor(settings.io_threads, thread_name_prefix="kvcache-load")
        # One saver thread keeps copy-outs in layer order.
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvcache-save")
        self.kv: list[torch.Tensor] = []
        self.block_size = 0
        self.layer_index: dict[str, int] = {}
        self.layout: PagedLayout | None = None
        self.copier = None
        self._touched: set[str] = set()  # chunk hashes put into / evicted from L1
        # Requests whose load failed this step: the KV they computed this step attended
        # to blocks that were not loaded, so none of it may be saved.
        self._step_failed_reqs: set[str] = set()
        self._failed_reqs: set[str] = set()
        self._report_lock = threading.Lock()
        self._errors: set[int] = set()
        self._errors_lock = threading.Lock()
        self._step_load: _StepLoad | None = None
        self._save_futures: list[Future] = []
        self._save_started = 0.0
        self.stats = metrics.KVCacheStats()
        metrics.TIER_CAPACITY.labels("l1").set(settings.l1_capacity_bytes)

    # -- setup ---------------------------------------------------------------------------
    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], num_blocks: int, block_size: int
    ) -> None:
        self.block_size = block_size
        names = _layer_order(list(kv_caches))
        self.layer_index = {n: i for i, n in enumerate(names)}
        self.kv = [kv_caches[n] for n in names]
        self.layout = PagedLayout.detect(self.kv[0], num_blocks)
        self.copier = make_copier(self.layout.device)
        log.info(
            "kvcache: %d layers, layout %s, mode %s", len(self.kv), self.layout.describe(), self.settings.mode
        )

    def chunk_key(self, chunk_hash: str) -> str:
        return f"kv:{self.ns}:r{self.tp_rank}:{chunk_hash}"

    # -- load ------------------------------------------------------------------------------
    def start_load(self, meta: KVCacheStepMetadata) -> None:
        if not meta.loads or not self.kv:
            return
        step = _StepLoad(self, meta.loads)
        step.chunk_blocks = meta.chunk_tokens // self.block_size
        self._step_load = step
        if self.settings.pipelined:
            step.submit_upto(self.settings.prefetch_window or len(self.kv))
        else:
            step.run_all_inline()

    def wait_for_layer(self, layer_name: str) -> None:
        step = self._step_load
        if step is None or not self.settings.pipelined:
            return
        layer = self.layer_index.get(layer_name)
        if layer is not None:
            step.wait_layer(layer)

    def finish_load(self) -> None:
        """Drain any load still in flight (a layer whose wait never came); then account."""
        step = self._step_load
        if step is None:
            return
        self._step_load = None
        step.finish()

    def _load_layer(self, step: _StepLoad, layer: int) -> object:
        """Copy one layer of every chunk in the step; failed chunks are marked, not raised."""
        assert self.layout is not None and self.copier is not None
        last_event = None
        for idx, item in enumerate(step.items):
            if step.failed[idx]:
                continue
            try:
                src = self._fetch(step, idx, item, layer)
                rows = [i for i, _ in item.blocks]
                if rows != list(range(src.shape[0])):
                    src = src[rows]
                block_ids = [b for _, b in item.blocks]
                if isinstance(self.copier, CudaCopier):
                    last_event = self.copier.scatter_async(
                        self.kv[layer], self.layout, block_ids, src, step.compute_ready
                    )
                else:
                    self.copier.scatter(self.kv[layer], self.layout, block_ids, src)
            except _LoadFailed as exc:
                step.fail(idx, exc.reason)
        return last_event

    def _fetch(self, step: _StepLoad, idx: int, item: ChunkTransfer, layer: int) -> torch.Tensor:
        assert self.layout is not None
        chunk = step.l1_chunks[idx]
        n_blocks = step.chunk_blocks
        if chunk is not None:
            src, crc = chunk.layers[layer], chunk.crcs[layer]
            if self._corrupt():
                src = torch.zeros_like(src)
            if crc is not None and self.settings.verify_checksum and codec.checksum(src) != crc:
                raise _LoadFailed("integrity")
            return src
        if self.l2 is None:
            raise _LoadFailed("absent")
        key = storage_key(self.ns, self.tp_rank, item.chunk_hash, layer)
        try:
            record = self.l2.get(key)
        except TierUnavailable as exc:
            metrics.L2_ERRORS.labels("get").inc()
            raise _LoadFailed("unavailable") from exc
        if record is None:
            raise _LoadFailed("absent")
        expected = codec.Expected(key, self.layout.dtype, self.layout.chunk_shape(n_blocks))
        if self._corrupt():
            head = len(record) - expected_nbytes(expected)
            record = record[:head] + bytes(len(record) - head)
        try:
            src, crc = codec.decode(record, expected, self.settings.verify_checksum)
        except codec.IntegrityError as exc:
            raise _LoadFailed("integrity") from exc
        metrics.BYTES_LOADED.labels(self.l2.name).inc(len(record))
        step.l2_layers[idx][layer] = (src, crc)
        return src

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
        if not meta.saves or not self.settings.pipelined:
            return
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        if not self._save_futures:
            self._save_started = time.perf_counter()
        assert self.copier is not None
        ready = self.copier.mark_compute()
        self._save_futures.append(self._saver.submit(self._gather_layer, layer, meta.saves, ready))

    def wait_for_save(self, meta: KVCacheStepMetadata | None) -> None:
        """The one barrier of the save path: every queued copy-out of this step finishes here."""
        self.finish_load()
        if meta is None or not meta.saves or not self.kv:
            self._save_futures = []
            with self._report_lock:
                self._failed_reqs |= self._step_failed_reqs
            self._step_failed_reqs = set()
            return
        t0 = time.perf_counter()
        if self.settings.pipelined and len(self._save_futures) == len(self.kv):
            per_layer = [f.result() for f in self._save_futures]
        else:
            # Sync mode (or layers whose save hook never ran): copy everything out now.
            ready = self.copier.mark_compute() if self.copier else None
            per_layer = [self._gather_layer(layer, meta.saves, ready) for layer in range(len(self.kv))]
        self._save_futures = []
        failed, self._step_failed_reqs = self._step_failed_reqs, set()
        keep = [i for i, item in enumerate(meta.saves) if item.req_id not in failed]
        with self._report_lock:
            self._failed_reqs |= failed
        self._commit([meta.saves[i] for i in keep], [[layer[i] for i in keep] for layer in per_layer])
        waited = time.perf_counter() - t0
        metrics.SAVE_SECONDS.observe(waited)
        self.stats.add("save_wait_s", waited)

    def _gather_layer(self, layer: int, saves: list[ChunkTransfer], ready: object) -> list[tuple]:
        assert self.layout is not None and self.copier is not None
        out = []
        for item in saves:
            ids = [b for _, b in item.blocks]
            if isinstance(self.copier, CudaCopier):
                host, done = self.copier.gather_async(self.kv[layer], self.layout, ids, ready)
                out.append((host, done))
            else:
                host = self.copier.gather(self.kv[layer], self.layout, ids)
                out.append((host, codec.checksum(host) if self.settings.l1_checksum else None))
        return out

    def _commit(self, saves: list[ChunkTransfer], per_layer: list[list[tuple]]) -> None:
        stored: set[str] = set()
        evicted: set[str] = set()
        tokens = 0
        for idx, item in enumerate(saves):
            layers: list[torch.Tensor] = []
            crcs: list[int | None] = []
            for layer_out in per_layer:
                host, crc_or_event = layer_out[idx]
                if not isinstance(crc_or_event, int):
                    self.copier.wait_host(crc_or_event)  # type: ignore[union-attr]
                    # On a GPU a host crc of every saved byte would sit on the barrier;
                    # with l1_checksum off the L2 writer computes it in the background.
                    crc_or_event = codec.checksum(host) if self.settings.l1_checksum else None
                layers.append(host)
                crcs.append(crc_or_event)
            chunk = StoredChunk(layers, crcs)
            for gone in self.l1.put(self.chunk_key(item.chunk_hash), chunk, chunk.nbytes):
                evicted.add(gone.rsplit(":", 1)[1])
            if self.chunk_key(item.chunk_hash) in self.l1:
                stored.add(item.chunk_hash)
                metrics.BYTES_SAVED.labels("l1").inc(chunk.nbytes)
            tokens += len(item.blocks) * self.block_size
            if self.writer is not None:
                for layer, (t, c) in enumerate(zip(layers, crcs, strict=True)):
                    self.writer.submit(storage_key(self.ns, self.tp_rank, item.chunk_hash, layer), t, c)
        metrics.TOKENS_SAVED.inc(tokens)
        metrics.EVICTIONS.labels("l1").inc(len(evicted))
        metrics.TIER_BYTES.labels("l1").set(self.l1.bytes_used)
        self.stats.add("tokens_saved", tokens)
        with self._report_lock:
            self._touched |= stored | evicted

    def promote(self, chunk_hash: str, chunk: StoredChunk) -> None:
        """Keep a chunk loaded from L2 in L1, so the next hit is a memory copy."""
        gone = self.l1.put(self.chunk_key(chunk_hash), chunk, chunk.nbytes)
        metrics.EVICTIONS.labels("l1").inc(len(gone))
        with self._report_lock:
            self._touched.add(chunk_hash)
            self._touched.update(g.rsplit(":", 1)[1] for g in gone)

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
        if self.writer is not None:
            self.writer.close()
        if self.l2 is not None:
            self.l2.close()


def expected_nbytes(expected: codec.Expected) -> int:
    n = 1
    for s in expected.shape:
        n *= s
    return n * torch.empty((), dtype=expected.dtype).element_size()


class _StepLoad:
    """The loads of one engine step: per-layer futures and per-chunk outcome."""

    def __init__(self, worker: KVCacheWorker, items: list[ChunkTransfer]) -> None:
        self.worker = worker
        self.items = items
        self.t0 = time.perf_counter()
        n_layers = len(worker.kv)
        self.chunk_blocks = 0
        self.l1_chunks: list[StoredChunk | None] = []
        for item in items:
            chunk = worker.l1.get(worker.chunk_key(item.chunk_hash))
            self.l1_chunks.append(chunk)
        self.failed = [False] * len(items)
        self.reasons: list[str] = [""] * len(items)
        self.l2_layers: list[list[tuple[torch.Tensor, int] | None]] = [[None] * n_layers for _ in items]
        self.futures: list[Future | None] = [None] * n_layers
        self.events: list[object] = [None] * n_layers
        self.waited = [False] * n_layers
        self.next_submit = 0
        self.compute_ready = worker.copier.mark_compute() if worker.copier else None
        self._lock = threading.Lock()

    def fail(self, idx: int, reason: str) -> None:
        with self._lock:
            if not self.failed[idx]:
                self.failed[idx] = True
                self.reasons[idx] = reason

    def submit_upto(self, count: int) -> None:
        while self.next_submit < min(count, len(self.futures)):
            layer = self.next_submit
            self.futures[layer] = self.worker._io.submit(self.worker._load_layer, self, layer)
            self.next_submit += 1

    def run_all_inline(self) -> None:
        for layer in range(len(self.futures)):
            ev = self.worker._load_layer(self, layer)
            self.worker.copier.wait_host(ev)  # type: ignore[union-attr]
            self.waited[layer] = True
        self.next_submit = len(self.futures)

    def wait_layer(self, layer: int) -> None:
        window = self.worker.settings.prefetch_window or len(self.futures)
        self.submit_upto(layer + 1)
        fut = self.futures[layer]
        if fut is not None and not self.waited[layer]:
            self.events[layer] = fut.result()
            self.worker.copier.wait_device(self.events[layer])  # type: ignore[union-attr]
            self.waited[layer] = True
        self.submit_upto(layer + 1 + window)

    def finish(self) -> None:
        self.submit_upto(len(self.futures))
        for layer, fut in enumerate(self.futures):
            if fut is not None and not self.waited[layer]:
                self.worker.copier.wait_host(fut.result())  # type: ignore[union-attr]
        w = self.worker
        bad: set[int] = set()
        failed_reqs: set[str] = set()
        loaded_tokens = 0
        for idx, item in enumerate(self.items):
            if self.failed[idx]:
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
            if tier == "l2":
                layers = self.l2_layers[idx]
                if all(x is not None for x in layers):
                    w.promote(item.chunk_hash, StoredChunk([x[0] for x in layers], [x[1] for x in layers]))
        if bad:
            with w._errors_lock:
                w._errors |= bad
        w._step_failed_reqs = failed_reqs
        block_tokens = w.block_size
        metrics.TOKENS_LOADED.inc(loaded_tokens * block_tokens)
        w.stats.add("tokens_loaded", loaded_tokens * block_tokens)
        elapsed = time.perf_counter() - self.t0
        metrics.LOAD_SECONDS.observe(elapsed)
        w.stats.add("load_s", elapsed)


_logged: set[str] = set()


def _log_once(tag: str, msg: str, *args: object) -> None:
    if tag not in _logged:
        _logged.add(tag)
        log.warning(msg, *args)
