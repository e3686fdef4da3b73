"""The worker's byte mover: paged layers, L1 slab memory, L2 reads, checksums, copies.

``TransferEngine`` owns what a copy needs and nothing of the bookkeeping: vLLM's paged KV
tensors (their layout, the copier for their device, numpy byte views for CPU chunk copies),
the L1 slab's memory, the load and save threads, L2 reads and decoding, and the L1 check
values. It keeps no index and no per-step state; a step's loads and saves are
``LoadJob`` / ``StoreJob`` (``transfer_jobs.py``), which use only the public methods here,
and ``KVCacheWorker`` (``worker.py``) decides what to move and records the outcome.

L1 is a slab of preallocated host memory (``tiers/slab.py``): a save copies a chunk's
blocks straight into a free slot, a load copies them back; runs of consecutive blocks move
as one slice copy, so a prompt's chunks usually cost one copy per layer each way.

With the full L1 check on CPU (the default), each chunk is copied and then hashed while its
bytes are still in the CPU's caches, and a step's chunks of every layer are shared out over
the cores the worker may use (``host_copy``; one core: inline). With an asynchronous copier
(CUDA), a save's check values are taken per layer on the hash threads as soon as that layer's
copy has landed, beside the next layers' compute (``submit_layer_sums``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvcache import codec, metrics
from kvcache.config import KVCacheSettings
from kvcache.host_copy import ChunkCopier, ChunkCopy, chunk_copy, host_array, host_threads, usable_cores
from kvcache.keys import storage_key
from kvcache.metadata import ChunkTransfer
from kvcache.tiers import L2Store, RecordRefused, TierUnavailable
from kvcache.tiers.slab import SlabPool
from kvcache.transfer import HostCopier, Move, PagedLayout, make_copier

# Under "vllm." so that records reach the handlers vLLM configures in its processes.
log = logging.getLogger(f"vllm.{__name__}")

# Threads that take a save's check values on an asynchronous (CUDA) copier, a layer at a time.
# xxh3 runs outside the GIL, so they hash in parallel with each other and with the thread that
# launches the forward; the full check of an 8B step (512 MiB, ~100 ms on one host thread on an
# H200 host) then spreads over the step's ~65 ms of compute (bench/RESULTS.md, gpu_kvcache).
MAX_HASH_THREADS = 4


def hash_threads() -> int:
    return max(1, min(MAX_HASH_THREADS, usable_cores()))


class LoadFailed(Exception):
    """A chunk that cannot be loaded; ``reason`` is the miss reason it is counted under."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def expected_nbytes(expected: codec.Expected) -> int:
    n = 1
    for s in expected.shape:
        n *= s
    return n * torch.empty((), dtype=expected.dtype).element_size()


@dataclass(frozen=True)
class SlotRun:
    """Whole chunks in consecutive L1 slots of one slab segment: one layer of them is one
    contiguous run of host rows, so a CUDA copy moves them all at once (a copy per chunk and
    layer costs a few kernel launches each, which dominated a GPU step's transfers)."""

    first_slot: int
    chunks: tuple[int, ...]  # indices into the job's items, in slot order
    block_ids: tuple[int, ...]  # the paged blocks, in host-row order


class TransferEngine:
    """Moves chunks between the paged layers, L1 slots and L2 records (no bookkeeping)."""

    def __init__(
        self,
        settings: KVCacheSettings,
        namespace_prefix: str,
        tp_rank: int = 0,
        l2: L2Store | None = None,
        mac: codec.Mac | None = None,
    ) -> None:
        self.settings = settings
        self.ns = namespace_prefix
        self.tp_rank = tp_rank
        self.l2 = l2
        self.mac = mac
        self._io = ThreadPoolExecutor(settings.io_threads, thread_name_prefix="kvcache-load")
        # One saver thread keeps CUDA copy-outs in layer order.
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvcache-save")
        self.slab: SlabPool | None = None  # sized in register
        self.kv: list[torch.Tensor] = []
        self.block_size = 0
        self.chunk_blocks = 0
        self.layer_ids: list[int] = []
        self.layout: PagedLayout | None = None
        self.copier: HostCopier | None = None
        self._chunk_copier: ChunkCopier | None = None  # CPU with the full L1 check
        self._hasher: ThreadPoolExecutor | None = None  # asynchronous copier, L1 check on
        self._kv_arrays: list[np.ndarray] = []  # and the paged layers as numpy byte views
        self.cuda = False

    # -- setup ---------------------------------------------------------------------------
    def register(
        self,
        kv: list[torch.Tensor],
        num_blocks: int,
        block_size: int,
        layer_ids: list[int],
        copier: HostCopier | None = None,
    ) -> None:
        """The paged layers in layer order, and their global layer numbers (storage keys).
        ``copier``: the device's own (``make_copier``) unless given."""
        self.block_size = block_size
        self.chunk_blocks = self.settings.chunk_size(block_size) // block_size
        self.layer_ids = layer_ids
        self.kv = kv
        self.layout = PagedLayout.detect(self.kv[0], num_blocks)
        self.copier = copier or make_copier(self.layout.device)
        self.cuda = self.copier.asynchronous
        if self.cuda and self.settings.l1_checksum != "off":
            self._hasher = ThreadPoolExecutor(hash_threads(), thread_name_prefix="kvcache-hash")
        if self.hash_per_chunk():
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

    @property
    def n_layers(self) -> int:
        return len(self.kv)

    def chunk_key(self, chunk_hash: str) -> str:
        return f"kv:{self.ns}:r{self.tp_rank}:{chunk_hash}"

    def storage_key(self, chunk_hash: str, layer: int) -> str:
        """The L2 key of one layer (by position here) of a chunk: keyed by its global number."""
        return storage_key(self.ns, self.tp_rank, chunk_hash, self.layer_ids[layer])

    def corrupt(self) -> bool:
        """The test-only fault hook: loaded payloads are zeroed while the file says so."""
        path = self.settings.fault_injection_file
        if not path or not os.path.exists(path):
            return False
        try:
            with open(path) as f:
                return f.read().strip() == "zeros"
        except OSError:
            return False

    # -- threads and ordering ------------------------------------------------------------
    def submit_io(self, fn: Callable[..., object], *args: object) -> Future:
        """Run ``fn`` on a load thread (L2 fetches; on CUDA, whole layer loads)."""
        return self._io.submit(fn, *args)

    def submit_save(self, fn: Callable[..., object], *args: object) -> Future:
        """Run ``fn`` on the one save thread (CUDA copy-outs, in layer order)."""
        return self._saver.submit(fn, *args)

    def mark_compute(self) -> object:
        """An event after the compute issued so far (None on CPU, or before register)."""
        return self.copier.mark_compute() if self.copier else None

    def wait_host(self, event: object) -> None:
        assert self.copier is not None
        self.copier.wait_host(event)

    def wait_device(self, event: object) -> None:
        assert self.copier is not None
        self.copier.wait_device(event)

    # -- L1 check values -----------------------------------------------------------------
    def l1_sum(self, view: torch.Tensor) -> int | None:
        mode = self.settings.l1_checksum
        if mode == "sampled":
            return codec.fingerprint(view)
        if mode == "full":
            return codec.checksum(view)
        return None

    def layer_sums(self, layer: int, slots: list[int]) -> list[int | None]:
        """Check values of one layer of many slots; consecutive slots share one sampling op."""
        assert self.slab is not None
        mode = self.settings.l1_checksum
        if mode != "sampled":
            return [self.l1_sum(self.slab.view(s, layer)) for s in slots]
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

    def submit_layer_sums(self, layer: int, slots: list[int], copied: object) -> Future:
        """Check values of one layer of ``slots`` (``layer_sums``), taken on a hash thread once
        the copy behind the event ``copied`` has landed: never of bytes still in flight."""
        assert self._hasher is not None

        def after_copy() -> list[int | None]:
            self.wait_host(copied)
            return self.layer_sums(layer, slots)

        return self._hasher.submit(after_copy)

    def hash_per_chunk(self) -> bool:
        """Full L1 checks on CPU run chunk by chunk, each right after that chunk's copy, so
        the hash reads bytes the copy just brought into the CPU's caches, and the chunks
        are shared out over the worker's cores (``host_copy``)."""
        return not self.cuda and self.settings.l1_checksum == "full"

    def chunk_copy(self, slot: int, layer: int, item: ChunkTransfer, into_kv: bool) -> ChunkCopy:
        assert self.slab is not None and self._kv_arrays
        rows, row0 = self.slab.row_bytes(slot, layer)
        return chunk_copy(self._kv_arrays[layer], rows, row0, item.blocks, self.chunk_blocks, into_kv)

    def run_chunk_copies(self, copies: list[ChunkCopy]) -> list[int]:
        """Run chunk copies over the copy threads; the checksum of each one's slot, in order."""
        assert self._chunk_copier is not None
        return self._chunk_copier.run(copies)

    # -- L2 ------------------------------------------------------------------------------
    def fetch_l2(
        self, item: ChunkTransfer, layer: int, corrupt: bool, slot: int | None
    ) -> tuple[torch.Tensor, int | None]:
        """One layer of a chunk from L2, decoded and checked, or ``LoadFailed``. With a
        ``slot`` the bytes are staged there and its L1 check value is returned too."""
        assert self.layout is not None and self.slab is not None
        if self.l2 is None:
            raise LoadFailed("absent")
        key = self.storage_key(item.chunk_hash, layer)
        expected = codec.Expected(key, self.layout.dtype, self.layout.chunk_shape(self.chunk_blocks))
        try:
            record = self.l2.get(key, max_bytes=codec.max_record_bytes(expected_nbytes(expected)))
        except TierUnavailable as exc:
            metrics.L2_ERRORS.labels("get").inc()
            raise LoadFailed("unavailable") from exc
        except RecordRefused as exc:
            log_once("record-refused", "kvcache: %s; counted as a miss", exc)
            raise LoadFailed("integrity") from exc
        if record is None:
            raise LoadFailed("absent")
        if not isinstance(record, (bytes, bytearray, memoryview)):
            raise LoadFailed("integrity")
        if corrupt:
            head = len(record) - expected_nbytes(expected)
            record = record[:head] + bytes(len(record) - head)
        try:
            src, crc = codec.decode(record, expected, self.settings.verify_checksum, self.mac)
        except codec.IntegrityError as exc:
            raise LoadFailed("integrity") from exc
        metrics.BYTES_LOADED.labels(self.l2.name).inc(len(record))
        if slot is None:
            return src, None
        # Stage in the slot that keeps this chunk in L1 afterwards (the next hit is a copy).
        view = self.slab.view(slot, layer)
        view.copy_(src)
        return view, crc if self.settings.l1_checksum == "full" else self.l1_sum(view)

    # -- copies between the paged layers and host rows -----------------------------------
    def scatter_rows(self, layer: int, moves: list[Move]) -> None:
        assert self.layout is not None and self.copier is not None
        self.copier.scatter_rows(self.kv[layer], self.layout, moves)

    def gather_rows(self, layer: int, moves: list[Move]) -> None:
        assert self.layout is not None and self.copier is not None
        self.copier.gather_rows(self.kv[layer], self.layout, moves)

    def slot_runs(self, slotted: list[tuple[int, int, ChunkTransfer]]) -> tuple[list[SlotRun], list[int]]:
        """Group ``(chunk index, slot, item)`` into runs of whole chunks in consecutive slots
        of one segment; the indices of chunks that are not whole (each copied alone)."""
        assert self.slab is not None
        whole = list(range(self.chunk_blocks))
        runs: list[list[tuple[int, int, ChunkTransfer]]] = []
        singles: list[int] = []
        for idx, slot, item in sorted(slotted, key=lambda c: c[1]):
            if [row for row, _ in item.blocks] != whole:
                singles.append(idx)
                continue
            prev = runs[-1][-1][1] if runs else -2
            if slot == prev + 1 and self.slab.segment_of(slot) == self.slab.segment_of(prev):
                runs[-1].append((idx, slot, item))
            else:
                runs.append([(idx, slot, item)])
        out = [
            SlotRun(run[0][1], tuple(i for i, _, _ in run), tuple(b for *_, it in run for _, b in it.blocks))
            for run in runs
        ]
        return out, singles

    def device_ids(self, block_ids: tuple[int, ...] | list[int], save: bool) -> torch.Tensor:
        """CUDA: block ids uploaded once on the save (or load) stream, for every layer's copy."""
        return self.copier.device_ids(list(block_ids), save)  # type: ignore[union-attr]

    def scatter_async(
        self, layer: int, block_ids: list[int] | torch.Tensor, src: torch.Tensor, ready: object
    ) -> object:
        """CUDA: copy host rows into blocks of one layer on the load stream; its event."""
        assert self.layout is not None
        return self.copier.scatter_async(  # type: ignore[union-attr]
            self.kv[layer], self.layout, block_ids, src, ready
        )

    def gather_async(
        self, layer: int, block_ids: list[int] | torch.Tensor, ready: object, dst: torch.Tensor
    ) -> object:
        """CUDA: copy blocks of one layer into host rows on the save stream; its event."""
        assert self.layout is not None
        return self.copier.gather_async(  # type: ignore[union-attr]
            self.kv[layer], self.layout, block_ids, ready, dst
        )

    def new_spill(self) -> torch.Tensor:
        """A temporary chunk (every layer) for an L2 write that found no free L1 slot."""
        assert self.layout is not None and self.copier is not None
        with torch.inference_mode(False):  # written by the save thread on CUDA
            return torch.empty(
                (len(self.kv), *self.layout.chunk_shape(self.chunk_blocks)),
                dtype=self.layout.dtype,
                pin_memory=self.copier.pinned,
            )

    def shutdown(self) -> None:
        self._io.shutdown(wait=True)
        self._saver.shutdown(wait=True)
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
        if self._chunk_copier is not None:
            self._chunk_copier.shutdown()


_logged: set[str] = set()


def log_once(tag: str, msg: str, *args: object, logger: logging.Logger = log) -> None:
    """Warn once per ``tag`` per process (the load and save paths share the tags)."""
    if tag not in _logged:
        _logged.add(tag)
        logger.warning(msg, *args)
