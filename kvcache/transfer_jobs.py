"""One engine step's loads and saves as jobs on a ``TransferEngine``.

The job API, the same on every device:

- load: ``LoadJob(engine, items, l1_chunks, promo_slots, corrupt)``, then ``submit(n)``
  (background work for layers below n), ``wait_layer(L)`` / ``complete_layer(L, ...)``
  (layer L usable by compute) and ``finish()`` (every layer done, nothing reads a slot any
  more); the outcome per chunk is ``failed`` / ``reasons``, the promoted chunks' check
  values ``promo_sums``;
- store: ``StoreJob(engine, items, slots, spill)``, then ``submit_layer(L)`` (queue layer
  L's copy-out) and ``finish()`` (every copy-out done; the error, if one failed), then
  ``wait_copied()`` before the slots are read (CUDA: DMA done, check values computed: each
  layer's on a hash thread once its copy landed, so only the last layers' are left at the
  barrier); ``release_all()`` gives the slots back when the step is dropped.

A job holds the step's state and decides what to move; the bytes move through the
engine's public methods. Which chunk goes where, what a hit or a miss counts, and what
enters L1 or L2 afterwards is the worker's (``KVCacheWorker``).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvcache.host_copy import ChunkCopy
from kvcache.metadata import ChunkTransfer
from kvcache.transfer import Move
from kvcache.transfer_engine import LoadFailed, SlotRun, TransferEngine, log_once


@dataclass
class L1Chunk:
    """One chunk in L1: a slab slot (every layer's blocks) and a check value per layer."""

    slot: int
    sums: list[int | None]  # per layer, by l1_checksum: fingerprint, crc32, or None (off)


def _chunk_rows(base: torch.Tensor, row0: int, item: ChunkTransfer) -> torch.Tensor:
    """The host rows of ``item``'s blocks from ``base[row0:]``: a view when they are
    consecutive, a gathered copy otherwise."""
    rows = [row0 + i for i, _ in item.blocks]
    consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
    return base.narrow(0, rows[0], len(rows)) if consecutive else base[rows]


def _run_copies(
    engine: TransferEngine, pending: list[tuple[int, int, ChunkCopy]]
) -> list[tuple[int, int, int]]:
    """Run a job's queued L1 copies (chunk index, layer, copy) on the copy threads: each
    one's chunk index and layer with the checksum of its slot."""
    if not pending:
        return []
    values = engine.run_chunk_copies([c for _, _, c in pending])
    return [(idx, layer, value) for (idx, layer, _), value in zip(pending, values, strict=True)]


class LoadJob:
    """The loads of one engine step: per-layer progress and per-chunk outcome.

    ``l1_chunks[i]`` is chunk i's L1 entry (None: not in L1), pinned by the caller (one slot
    reference each) for the job, so no save or eviction can reuse its memory while a copy
    may still read it; ``promo_slots[i]`` is the slot an L2 chunk is staged in (None: not
    kept in L1).
    """

    def __init__(
        self,
        engine: TransferEngine,
        items: list[ChunkTransfer],
        l1_chunks: list[L1Chunk | None],
        promo_slots: list[int | None],
        corrupt: bool = False,
        t0: float | None = None,
    ) -> None:
        self.engine = engine
        self.items = items
        self.t0 = time.perf_counter() if t0 is None else t0
        n_layers = engine.n_layers
        self.l1_chunks = l1_chunks
        self.promo_slots = promo_slots
        self.uses_l2 = any(c is None for c in self.l1_chunks) and engine.l2 is not None
        self.corrupt = corrupt
        self.failed = [False] * len(items)
        self.reasons: list[str] = [""] * len(items)
        self.sources: list[list[torch.Tensor | None]] = [[None] * n_layers for _ in items]
        self.promo_sums: list[list[int | None]] = [[None] * n_layers for _ in items]
        self.futures: list[Future | None] = [None] * n_layers
        self.events: list[object] = [None] * n_layers
        self.done = [False] * n_layers
        self.next_submit = 0
        self.compute_ready = engine.mark_compute()
        # CPU full check: (chunk, layer, copy out of its L1 slot), checked once copied.
        self.host_copies: list[tuple[int, int, ChunkCopy]] = []
        self._lock = threading.Lock()
        self._run_ids: dict[tuple[int, ...], torch.Tensor] = {}  # CUDA: device block ids per run
        # Compute-thread time spent on this step's loads (start_load_kv, the per-layer
        # waits, and completing at the barrier): what loading costs the forward.
        self.blocked_s = 0.0

    def fail(self, idx: int, reason: str) -> None:
        with self._lock:
            if not self.failed[idx]:
                self.failed[idx] = True
                self.reasons[idx] = reason

    def submit(self, count: int) -> None:
        """Start background work for layers below ``count``: the whole load on CUDA (side
        stream), only L2 fetches on CPU (L1 copies run on the compute thread)."""
        e = self.engine
        while self.next_submit < min(count, len(self.futures)):
            layer = self.next_submit
            if e.cuda:
                self.futures[layer] = e.submit_io(self.load_layer_cuda, layer)
            elif self.uses_l2:
                self.futures[layer] = e.submit_io(self.prepare_layer, layer)
            self.next_submit += 1

    def run_host_copies(self) -> None:
        """Run the queued L1 copies and fail every chunk whose bytes do not match."""
        pending, self.host_copies = self.host_copies, []
        for idx, layer, value in _run_copies(self.engine, pending):
            expected = self.l1_chunks[idx].sums[layer]  # type: ignore[union-attr]
            if expected is not None and value != expected:
                self.fail(idx, "integrity")

    def complete_layer(self, layer: int, host_wait: bool, run_copies: bool = True) -> None:
        """Make ``layer``'s load complete (CPU) or ordered before compute (CUDA); with
        ``run_copies`` False the CPU's L1 copies wait for ``run_host_copies``."""
        if self.done[layer]:
            return
        e = self.engine
        fut = self.futures[layer]
        if e.cuda:
            ev = fut.result() if fut is not None else self.load_layer_cuda(layer)
            self.events[layer] = ev
            (e.wait_host if host_wait else e.wait_device)(ev)
        else:
            if fut is not None:
                fut.result()
            else:
                self.prepare_layer(layer)
            self.scatter_layer(layer)
            if run_copies:
                self.run_host_copies()
        self.done[layer] = True

    def wait_layer(self, layer: int) -> None:
        window = self.engine.settings.prefetch_window or len(self.futures)
        self.submit(layer + 1)
        self.complete_layer(layer, host_wait=False)
        self.submit(layer + 1 + window)

    def finish(self) -> None:
        """Complete every layer whose wait never came, and wait for every copy (they may
        still read pinned slots): afterwards the caller may release the slots."""
        t0 = time.perf_counter()
        for layer in range(len(self.futures)):
            self.complete_layer(layer, host_wait=True, run_copies=False)
        self.run_host_copies()
        for ev in self.events:  # copies may still read pinned slots: done before release
            self.engine.wait_host(ev)
        self.blocked_s += time.perf_counter() - t0

    # -- one layer -----------------------------------------------------------------------
    def prepare_layer(self, layer: int) -> None:
        """Fetch, check and stage one layer of the step's L2 chunks (L1 chunks need nothing)."""
        for idx, item in enumerate(self.items):
            if self.failed[idx] or self.l1_chunks[idx] is not None:
                continue
            try:
                src, value = self.engine.fetch_l2(item, layer, self.corrupt, self.promo_slots[idx])
                self.promo_sums[idx][layer] = value
                self.sources[idx][layer] = src
            except LoadFailed as exc:
                self.fail(idx, exc.reason)
            except Exception as exc:  # nothing a tier returns may raise into the forward
                log_once(
                    "load-error", "kvcache: load of chunk %s failed: %r; recomputing it", item.chunk_hash, exc
                )
                self.fail(idx, "integrity")

    def check_l1(self, layer: int, sums_later: bool) -> dict[int, torch.Tensor]:
        """Check this layer of the step's L1 chunks; failures are marked. Returns, under the
        test-only fault injection, the zeros that replace each chunk's bytes. With
        ``sums_later`` the checksums are left to ``scatter_layer``, chunk by chunk."""
        e = self.engine
        assert e.slab is not None
        checked: dict[int, L1Chunk] = {}
        for idx, chunk in enumerate(self.l1_chunks):
            if chunk is None or self.failed[idx]:
                continue
            if e.slab.owner(chunk.slot) != e.chunk_key(self.items[idx].chunk_hash):
                self.fail(idx, "integrity")  # the slot no longer holds this chunk
                continue
            checked[idx] = chunk
        replaced: dict[int, torch.Tensor] = {}
        if self.corrupt:
            replaced = {i: torch.zeros_like(e.slab.view(c.slot, layer)) for i, c in checked.items()}
        if sums_later or not e.settings.verify_checksum or e.settings.l1_checksum == "off":
            return replaced
        if self.corrupt:
            got = [e.l1_sum(replaced[i]) for i in checked]
        else:
            got = e.layer_sums(layer, [c.slot for c in checked.values()])
        for (idx, chunk), value in zip(checked.items(), got, strict=True):
            expected = chunk.sums[layer]
            if expected is not None and value != expected:
                self.fail(idx, "integrity")
        return replaced

    def scatter_layer(self, layer: int) -> object:
        """Copy one layer of every loadable chunk into the paged cache; failed chunks are
        marked, not raised. Returns the CUDA event of the last copy.

        A chunk that fails its check is not copied, except under the CPU full check, which
        hashes each L1 chunk right after copying it (its bytes are then in the caches): a
        failed chunk's blocks then hold the bad bytes instead of whatever they held before.
        Either way they are unusable until recomputed, and they are reported as failed
        (vLLM recomputes them; saves that read them are dropped)."""
        e = self.engine
        assert e.slab is not None
        # The test-only fault hook replaces the bytes before the check: it keeps the batched path.
        per_chunk = e.hash_per_chunk() and e.settings.verify_checksum and not self.corrupt
        replaced = self.check_l1(layer, sums_later=per_chunk)
        moves: list[Move] = []
        last_event = None
        slotted: list[tuple[int, int, ChunkTransfer]] = []  # CUDA: copied by runs of slots
        for idx, item in enumerate(self.items):
            if self.failed[idx]:
                continue
            chunk = self.l1_chunks[idx]
            if per_chunk and chunk is not None:
                self.host_copies.append((idx, layer, e.chunk_copy(chunk.slot, layer, item, into_kv=True)))
                continue
            slot = chunk.slot if chunk is not None else self.promo_slots[idx]
            if e.cuda and slot is not None and idx not in replaced:
                slotted.append((idx, slot, item))
                continue
            if idx in replaced:
                base, row0 = replaced[idx], 0
            elif slot is not None:
                base, row0 = e.slab.rows(slot, layer)
            else:
                src = self.sources[idx][layer]
                if src is None:  # not fetched (its chunk failed on another layer)
                    continue
                base, row0 = src, 0
            if e.cuda:
                src = _chunk_rows(base, row0, item)
                last_event = e.scatter_async(layer, [b for _, b in item.blocks], src, self.compute_ready)
            else:
                moves.extend((base, row0 + i, b) for i, b in item.blocks)
        if moves:
            e.scatter_rows(layer, moves)
        if slotted:
            last_event = self.scatter_slot_runs(layer, slotted) or last_event
        return last_event

    def scatter_slot_runs(self, layer: int, slotted: list[tuple[int, int, ChunkTransfer]]) -> object:
        """CUDA: copy one layer of chunks held in L1 slots, one copy per run of consecutive
        slots (their device block ids uploaded once per job); the last copy's event."""
        e = self.engine
        assert e.slab is not None
        runs, singles = e.slot_runs(slotted)
        last_event = None
        for run in runs:
            ids = self._run_ids.get(run.chunks)
            if ids is None:  # two load threads may both upload it: same ids, no harm
                ids = self._run_ids[run.chunks] = e.device_ids(run.block_ids, save=False)
            base, row0 = e.slab.rows(run.first_slot, layer)
            src = base.narrow(0, row0, len(run.block_ids))
            last_event = e.scatter_async(layer, ids, src, self.compute_ready)
        slots = {idx: slot for idx, slot, _ in slotted}
        for idx in singles:
            item = self.items[idx]
            src = _chunk_rows(*e.slab.rows(slots[idx], layer), item)
            last_event = e.scatter_async(layer, [b for _, b in item.blocks], src, self.compute_ready)
        return last_event

    def load_layer_cuda(self, layer: int) -> object:
        self.prepare_layer(layer)
        return self.scatter_layer(layer)


class StoreJob:
    """The saves of one engine step: a slot (or, when none is free, a spill buffer for the
    L2 write only) per chunk, and per-layer copy state.

    ``slots[i]`` is the slot chunk i is copied into (one reference, the caller's; None: no
    free slot); with ``spill`` a chunk without a slot gets a temporary buffer for its L2
    write, without it the chunk is not copied at all.
    """

    def __init__(
        self, engine: TransferEngine, items: list[ChunkTransfer], slots: list[int | None], spill: bool
    ) -> None:
        assert engine.slab is not None and engine.layout is not None and engine.copier is not None
        self.engine = engine
        self.items = items
        n_layers = engine.n_layers
        self.slots = slots
        self.spill: list[torch.Tensor | None] = [
            engine.new_spill() if slot is None and spill else None for slot in slots
        ]
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
        # CUDA: runs of slots with their block ids on the device, and chunks copied alone.
        self._cuda_plan: tuple[list[tuple[SlotRun, torch.Tensor]], list[int]] | None = None
        # The chunks with a slot, and the slots: their check values are taken per layer.
        self._held = [(idx, slot) for idx, slot in enumerate(slots) if slot is not None]
        # CUDA: per layer, its slots' check values once its copy landed (a hash thread's).
        self.layer_sums: list[Future | None] = [None] * n_layers

    def submit_layer(self, layer: int) -> None:
        """Queue ``layer``'s copy-out on the save thread, after the compute issued so far."""
        ready = self.engine.mark_compute()
        self.futures[layer] = self.engine.submit_save(self.gather_layer, layer, ready)
        self.issued[layer] = True

    def finish(self) -> BaseException | None:
        """Every copy-out of the step done (layers never submitted are copied out here);
        the first error, if any failed (the step must then be dropped)."""
        ready = None
        error: BaseException | None = None
        for layer in range(self.engine.n_layers):
            fut = self.futures[layer]
            try:
                if fut is not None:
                    fut.result()
                elif not self.issued[layer] and error is None:
                    # Sync mode (or a layer whose save hook never ran): copy it out now.
                    if ready is None:
                        ready = self.engine.mark_compute()
                    self.gather_layer(layer, ready)
            except Exception as exc:  # a failed copy-out is a skipped save, never an engine error
                error = error or exc
        if error is None:
            try:
                self.run_host_copies()
            except Exception as exc:
                error = exc
        return error

    def wait_copied(self) -> None:
        """CUDA: wait for the DMA copies and the check values their hash threads took (a
        layer's were taken as soon as its copy landed, beside the next layers' compute).
        CPU: already done."""
        e = self.engine
        if not e.cuda:
            return
        for ev in self.events:  # spill buffers' copies too (they have no check values)
            e.wait_host(ev)
        slots = [slot for _, slot in self._held]
        for layer in range(e.n_layers):
            fut = self.layer_sums[layer]
            values = fut.result() if fut is not None else e.layer_sums(layer, slots)
            for (idx, _), value in zip(self._held, values, strict=True):
                self.sums[idx][layer] = value

    def gather_layer(self, layer: int, ready: object) -> None:
        e = self.engine
        assert e.slab is not None
        if e.cuda:
            if self._cuda_plan is None:  # the same for every layer: made (and uploaded) once
                slotted = [(i, s, self.items[i]) for i, s in enumerate(self.slots) if s is not None]
                runs, singles = e.slot_runs(slotted)
                singles += [i for i, s in enumerate(self.slots) if s is None and self.copied[i]]
                self._cuda_plan = ([(run, e.device_ids(run.block_ids, save=True)) for run in runs], singles)
            runs, singles = self._cuda_plan
            for run, ids in runs:
                base, row0 = e.slab.rows(run.first_slot, layer)
                dst = base.narrow(0, row0, len(run.block_ids))
                self.events[layer] = e.gather_async(layer, ids, ready, dst)
            for idx in singles:
                item = self.items[idx]
                dst = self.target(idx, layer).narrow(0, 0, len(item.blocks))
                self.events[layer] = e.gather_async(layer, [b for _, b in item.blocks], ready, dst)
            if self._held and e.settings.l1_checksum != "off":
                # The save stream runs in order: this layer's last event covers all its copies.
                slots = [slot for _, slot in self._held]
                self.layer_sums[layer] = e.submit_layer_sums(layer, slots, self.events[layer])
            return
        per_chunk = e.hash_per_chunk()
        moves: list[Move] = []
        for idx, item in enumerate(self.items):
            slot = self.slots[idx]
            if not self.copied[idx]:
                continue
            if slot is not None:
                base, row0 = e.slab.rows(slot, layer)
            else:
                base, row0 = self.target(idx, layer), 0
            if per_chunk and slot is not None:
                self.host_copies.append((idx, layer, e.chunk_copy(slot, layer, item, into_kv=False)))
            else:
                moves.extend((base, row0 + i, b) for i, b in item.blocks)
        e.gather_rows(layer, moves)
        if per_chunk:
            return  # the slots' copies and check values: run_host_copies
        values = e.layer_sums(layer, [slot for _, slot in self._held])
        for (idx, _), value in zip(self._held, values, strict=True):
            self.sums[idx][layer] = value

    def run_host_copies(self) -> None:
        pending, self.host_copies = self.host_copies, []
        for idx, layer, value in _run_copies(self.engine, pending):
            self.sums[idx][layer] = value

    def target(self, idx: int, layer: int) -> torch.Tensor:
        slot = self.slots[idx]
        if slot is not None:
            return self.engine.slab.view(slot, layer)  # type: ignore[union-attr]
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
                self.engine.wait_host(ev)
            except Exception:
                pass
        for fut in self.layer_sums:  # a hash thread may still read the slots
            if fut is not None:
                try:
                    fut.result()
                except Exception:
                    pass
        for slot in self.slots:
            if slot is not None:
                self.engine.slab.unref(slot)  # type: ignore[union-attr]
