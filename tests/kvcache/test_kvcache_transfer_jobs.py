"""The transfer engine and its jobs on their own (no KVCacheWorker, no L1 index): a store
job into slab slots, load jobs back from them and from L2 records, and the checks that
fail a damaged chunk."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from kvcache import codec
from kvcache.config import KVCacheSettings
from kvcache.metadata import ChunkTransfer
from kvcache.transfer import HostCopier, PagedLayout
from kvcache.transfer_engine import TransferEngine
from kvcache.transfer_jobs import L1Chunk, LoadJob, StoreJob

LAYERS, BLOCKS, HEADS, BS, DIM2 = 3, 16, 2, 4, 8
SAVES = [ChunkTransfer("a", [(0, 3), (1, 4)]), ChunkTransfer("b", [(0, 9), (1, 7)])]


class _DictStore:
    """An L2 that is a dict of records."""

    name = "dict"

    def __init__(self) -> None:
        self.records: dict[str, bytes] = {}

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        return self.records.get(key)


class LateCopier(HostCopier):
    """The CUDA copier's contract on the CPU: copies are queued in order on one thread of
    their own (a side stream) and land later; an event is a future that is done when its copy
    is. The jobs' asynchronous (CUDA) path runs on it here: what reads a slot before its copy's
    event is done sees the slot's old bytes. A copy lands ``delay_s`` after it is queued, or,
    with ``gate``, once the test releases it (one ``gate.release()`` per copy)."""

    asynchronous = True

    def __init__(self, delay_s: float = 0.0, gate: threading.Semaphore | None = None) -> None:
        self.delay_s = delay_s
        self.gate = gate
        self.stream = ThreadPoolExecutor(1, thread_name_prefix="late-copier")

    def device_ids(self, block_ids: list[int], save: bool) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long)

    def _later(self, copy) -> Future:
        def run() -> None:
            if self.gate is not None:
                self.gate.acquire()
            else:
                time.sleep(self.delay_s)
            copy()

        return self.stream.submit(run)

    def gather_async(self, kv, layout: PagedLayout, block_ids, ready, host: torch.Tensor) -> Future:
        ids = torch.as_tensor(block_ids, dtype=torch.long)
        return self._later(lambda: host.copy_(kv.index_select(layout.block_dim, ids)))

    def scatter_async(self, kv, layout: PagedLayout, block_ids, src: torch.Tensor, ready) -> Future:
        ids = torch.as_tensor(block_ids, dtype=torch.long)
        return self._later(lambda: kv.index_copy_(layout.block_dim, ids, src.clone()))

    def wait_host(self, event: Future | None) -> None:
        if event is not None:
            event.result()

    wait_device = wait_host  # the "device" is this host


def _engine(
    l2: _DictStore | None = None, copier: HostCopier | None = None, **extra: object
) -> tuple[TransferEngine, list[torch.Tensor]]:
    settings = KVCacheSettings.from_extra({"chunk_tokens": 2 * BS, **extra})
    engine = TransferEngine(settings, "ns", 0, l2)  # type: ignore[arg-type]
    kv = [torch.randn(BLOCKS, HEADS, BS, DIM2) + i for i in range(LAYERS)]
    engine.register(kv, BLOCKS, BS, list(range(LAYERS)), copier=copier)
    return engine, kv


def _store(engine: TransferEngine, kv: list[torch.Tensor]) -> tuple[StoreJob, list[L1Chunk]]:
    """SAVES copied into fresh slots by a store job; the slots' bytes and check values checked."""
    assert engine.slab is not None
    before = [t.clone() for t in kv]
    slots = [engine.slab.alloc(engine.chunk_key(item.chunk_hash)) for item in SAVES]
    job = StoreJob(engine, SAVES, slots, spill=False)
    for layer in range(LAYERS):
        job.submit_layer(layer)
    assert job.finish() is None
    job.wait_copied()
    for idx, (item, slot) in enumerate(zip(SAVES, slots, strict=True)):
        assert slot is not None
        for layer in range(LAYERS):
            view = engine.slab.view(slot, layer)
            assert torch.equal(view, before[layer][[b for _, b in item.blocks]])
            assert job.sums[idx][layer] is not None and job.sums[idx][layer] == engine.l1_sum(view)
    assert all(torch.equal(t, b) for t, b in zip(kv, before, strict=True))  # the paged layers untouched
    return job, [L1Chunk(slot, job.sums[i]) for i, slot in enumerate(slots) if slot is not None]


@pytest.mark.parametrize("copier", ["host", "late"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("l1_checksum", ["full", "sampled"])
def test_a_store_job_then_load_jobs_move_the_bytes_and_a_damaged_slot_fails(
    l1_checksum: str, threads: int, copier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kvcache.transfer_engine.host_threads", lambda: threads)
    monkeypatch.setattr("kvcache.transfer_engine.hash_threads", lambda: threads)
    engine, kv = _engine(copier=LateCopier(0.002) if copier == "late" else None, l1_checksum=l1_checksum)
    _, chunks = _store(engine, kv)
    # Load both into other blocks, a's block 0 skipped (as if vLLM held it), layer by layer.
    loads = [ChunkTransfer("a", [(1, 12)]), ChunkTransfer("b", [(0, 13), (1, 14)])]
    job = LoadJob(engine, loads, list(chunks), [None, None])
    job.submit(LAYERS)
    for layer in range(LAYERS):
        job.wait_layer(layer)
    job.finish()
    assert job.failed == [False, False]
    assert all(torch.equal(t[12], t[4]) and torch.equal(t[13], t[9]) and torch.equal(t[14], t[7]) for t in kv)
    # Zero layer 1 of b's slot (at rest in L1): b fails its check, a still loads.
    assert engine.slab is not None
    engine.slab.view(chunks[1].slot, 1).zero_()
    again = [ChunkTransfer("a", [(0, 10)]), ChunkTransfer("b", [(0, 11)])]
    job = LoadJob(engine, again, list(chunks), [None, None])
    job.finish()  # no per-layer waits came: finish completes every layer
    assert job.failed == [False, True] and job.reasons == ["", "integrity"]
    assert all(torch.equal(t[10], t[3]) for t in kv)
    engine.shutdown()


def test_asynchronous_saves_hash_each_layer_after_its_copy_lands_and_before_the_barrier() -> None:
    """The per-layer save path (what a CUDA save runs): each layer's copies land late, on their
    own thread, one at a time as the test lets them. A layer's check values must be of the
    bytes that landed (a hash taken before the copy's event would be of the slot's old bytes:
    the fault between copy and hash), taken on a hash thread as soon as that layer landed,
    while later layers are still in flight, not all at the barrier."""
    gate = threading.Semaphore(0)
    engine, kv = _engine(copier=LateCopier(gate=gate), l1_checksum="full")
    assert engine.slab is not None
    before = [t.clone() for t in kv]
    slots = [engine.slab.alloc(engine.chunk_key(item.chunk_hash)) for item in SAVES]
    for slot in slots:  # stale bytes in the slots: what a hash taken too early would see
        for layer in range(LAYERS):
            engine.slab.view(slot, layer).fill_(7.0)
    hashed: list[tuple[int, str]] = []
    sums_of = engine.layer_sums

    def recorded(layer: int, held: list[int]) -> list[int | None]:
        hashed.append((layer, threading.current_thread().name))
        return sums_of(layer, held)

    engine.layer_sums = recorded  # type: ignore[method-assign]
    job = StoreJob(engine, SAVES, slots, spill=False)
    for layer in range(LAYERS):
        job.submit_layer(layer)
    assert job.finish() is None  # every copy queued, none landed: nothing hashed yet
    assert hashed == []
    gate.release()  # SAVES sit in consecutive slots: one copy per layer; layer 0's lands
    job.layer_sums[0].result()
    assert [layer for layer, _ in hashed] == [0]  # layers 1 and 2 wait for their copies
    assert hashed[0][1].startswith("kvcache-hash"), hashed  # not the compute thread
    gate.release(LAYERS - 1)
    job.wait_copied()
    assert sorted(layer for layer, _ in hashed) == list(range(LAYERS))
    for idx, (item, slot) in enumerate(zip(SAVES, slots, strict=True)):
        for layer in range(LAYERS):
            view = engine.slab.view(slot, layer)
            assert torch.equal(view, before[layer][[b for _, b in item.blocks]])
            assert job.sums[idx][layer] == codec.checksum(view)  # of the landed bytes, not the 7s
    engine.shutdown()


def test_a_load_job_from_l2_stages_in_its_slot_and_fails_a_bad_or_missing_record() -> None:
    l2 = _DictStore()
    producer, kv_p = _engine()
    store, _ = _store(producer, kv_p)
    for idx, item in enumerate(SAVES):  # the records an L2 write would hold
        for layer in range(LAYERS):
            key = producer.storage_key(item.chunk_hash, layer)
            l2.records[key] = codec.encode(key, store.target(idx, layer), store.sums[idx][layer])
    consumer, kv_c = _engine(l2)
    assert consumer.slab is not None
    promo = consumer.slab.alloc(consumer.chunk_key("a"))
    loads = [ChunkTransfer("a", [(0, 5), (1, 6)]), ChunkTransfer("b", [(0, 8), (1, 2)])]
    job = LoadJob(consumer, loads, [None, None], [promo, None])
    assert job.uses_l2
    job.submit(1)  # L2 fetches go to the load threads, one layer ahead here
    for layer in range(LAYERS):
        job.wait_layer(layer)
    job.finish()
    assert job.failed == [False, False]
    for tp, tc in zip(kv_p, kv_c, strict=True):
        assert torch.equal(tc[5], tp[3]) and torch.equal(tc[6], tp[4])
        assert torch.equal(tc[8], tp[9]) and torch.equal(tc[2], tp[7])
    # a was staged in its slot, with the check values its L1 entry will carry.
    assert promo is not None
    assert job.promo_sums[0] == [consumer.l1_sum(consumer.slab.view(promo, layer)) for layer in range(LAYERS)]
    assert job.promo_sums[0] == store.sums[0]
    # One flipped payload byte in b's layer 2 record, and a's layer 1 record gone.
    bad = bytearray(l2.records[producer.storage_key("b", 2)])
    bad[-5] ^= 0x01
    l2.records[producer.storage_key("b", 2)] = bytes(bad)
    del l2.records[producer.storage_key("a", 1)]
    job = LoadJob(consumer, loads, [None, None], [None, None])
    job.submit(LAYERS)
    job.finish()
    assert job.failed == [True, True] and job.reasons == ["absent", "integrity"]
    consumer.shutdown()
    producer.shutdown()


def test_slot_runs_group_whole_chunks_in_consecutive_slots_of_one_segment() -> None:
    """CUDA copies move one run of slots per layer at once (bench/gpu_kvcache.py measures
    why): a run holds only whole chunks, in consecutive slots of one slab segment, and its
    block ids follow the slots' host rows."""
    engine, _ = _engine()
    assert engine.slab is not None
    engine.slab.slots_per_segment = 4  # segment boundary between slots 3 and 4

    def whole(h: str, b0: int) -> ChunkTransfer:
        return ChunkTransfer(h, [(0, b0), (1, b0 + 1)])

    slotted = [
        (0, 2, whole("a", 10)),  # listed out of slot order
        (1, 1, whole("b", 0)),
        (2, 5, ChunkTransfer("partial", [(0, 6)])),  # not a whole chunk: copied alone
        (3, 3, whole("c", 4)),
        (4, 4, whole("d", 12)),  # consecutive with slot 3 but in the next segment
        (5, 7, whole("e", 8)),  # slot 6 is free: a new run
    ]
    runs, singles = engine.slot_runs(slotted)
    assert singles == [2]
    assert [(r.first_slot, r.chunks, r.block_ids) for r in runs] == [
        (1, (1, 0, 3), (0, 1, 10, 11, 4, 5)),
        (4, (4,), (12, 13)),
        (7, (5,), (8, 9)),
    ]
