"""The worker's data path on real tensors, without vLLM: save, then load into other blocks."""

from __future__ import annotations

import pytest
import torch

from kvcache import codec
from kvcache.config import KVCacheSettings
from kvcache.metadata import ChunkTransfer, KVCacheStepMetadata
from kvcache.tiers import FilesystemStore, RedisStore
from kvcache.transfer_jobs import StoreJob
from kvcache.worker import KVCacheWorker

LAYERS, BLOCKS, HEADS, BS, DIM2 = 3, 16, 2, 4, 8


def _kv() -> dict[str, torch.Tensor]:
    # vLLM CPU layout: [num_blocks, kv_heads, block_size, 2*head_dim]
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(BLOCKS, HEADS, BS, DIM2) for i in range(LAYERS)}


def _worker(settings: dict, l2=None) -> tuple[KVCacheWorker, dict[str, torch.Tensor]]:
    w = KVCacheWorker(KVCacheSettings.from_extra(settings), "ns", 0, l2)
    kv = _kv()
    w.register_kv_caches(kv, BLOCKS, BS)
    return w, kv


def _step(w: KVCacheWorker, meta: KVCacheStepMetadata) -> set[int]:
    """One engine step as vLLM drives it: load, per layer wait + save, then the barrier."""
    w.start_load(meta)
    for name in w.layer_index:
        w.wait_for_layer(name)
        w.save_layer(name, meta)
    w.wait_for_save(meta)
    return w.take_load_errors()


def _fill(kv: dict[str, torch.Tensor], blocks: list[int]) -> None:
    for i, t in enumerate(kv.values()):
        for b in blocks:
            t[b] = torch.randn(HEADS, BS, DIM2) + i


@pytest.mark.parametrize("mode", ["pipelined", "sync"])
@pytest.mark.parametrize("window", [0, 1])
def test_save_then_load_roundtrip(mode: str, window: int) -> None:
    w, kv = _worker({"mode": mode, "prefetch_window": window, "chunk_tokens": 2 * BS})
    _fill(kv, [3, 7, 4, 9])
    saves = [ChunkTransfer("h0", [(0, 3), (1, 7)]), ChunkTransfer("h1", [(0, 4), (1, 9)])]
    assert _step(w, KVCacheStepMetadata(saves=saves, chunk_tokens=2 * BS)) == set()
    report = w.take_report()
    assert report is not None and report.stored == {"h0", "h1"}
    # Load both chunks into different blocks; skip block 0 of h0 (as if vLLM had it cached).
    loads = [ChunkTransfer("h0", [(1, 12)]), ChunkTransfer("h1", [(0, 13), (1, 14)])]
    assert _step(w, KVCacheStepMetadata(loads=loads, chunk_tokens=2 * BS)) == set()
    for t in kv.values():
        assert torch.equal(t[12], t[7]) and torch.equal(t[13], t[4]) and torch.equal(t[14], t[9])
    w.shutdown()


def test_missing_and_corrupt_chunks_are_reported(tmp_path) -> None:
    flag = tmp_path / "fault"
    w, kv = _worker({"fault_injection_file": str(flag)})
    _fill(kv, [1, 2])
    meta = KVCacheStepMetadata(
        saves=[ChunkTransfer("a", [(0, 1)]), ChunkTransfer("b", [(0, 2)])], chunk_tokens=BS
    )
    _step(w, meta)
    before = [t[5].clone() for t in kv.values()]
    loads = [ChunkTransfer("a", [(0, 5)]), ChunkTransfer("zz", [(0, 6)])]
    flag.write_text("zeros")
    assert _step(w, KVCacheStepMetadata(loads=loads, chunk_tokens=BS)) == {5, 6}
    # A corrupt chunk is never copied into the paged cache.
    assert all(torch.equal(t[5], b) for t, b in zip(kv.values(), before, strict=True))
    flag.unlink()
    assert _step(w, KVCacheStepMetadata(loads=loads, chunk_tokens=BS)) == {6}
    assert all(torch.equal(t[5], t[1]) for t in kv.values())
    w.shutdown()


@pytest.mark.parametrize("backend", ["fs", "redis"])
@pytest.mark.service
def test_second_process_loads_from_l2(backend: str, tmp_path, redis_server) -> None:
    """A producer's saves reach L2; a fresh worker (empty L1) loads them and promotes to L1."""

    def store():
        return FilesystemStore(str(tmp_path)) if backend == "fs" else RedisStore(redis_server.url)

    prod, kv_p = _worker({}, store())
    _fill(kv_p, [2, 3])
    with torch.inference_mode():  # as in vLLM's forward: L1 memory is first reserved here
        _step(prod, KVCacheStepMetadata(saves=[ChunkTransfer("c0", [(0, 2)]), ChunkTransfer("c1", [(0, 3)])],
                                        chunk_tokens=BS))  # fmt: skip
    assert prod.writer is not None and prod.writer.flush()
    cons, kv_c = _worker({}, store())
    loads = [ChunkTransfer("c0", [(0, 10)]), ChunkTransfer("c1", [(0, 11)])]
    with torch.inference_mode():  # load threads stage L2 records into L1 slots
        assert _step(cons, KVCacheStepMetadata(loads=loads, chunk_tokens=BS)) == set()
    for tp, tc in zip(kv_p.values(), kv_c.values(), strict=True):
        assert torch.equal(tc[10], tp[2]) and torch.equal(tc[11], tp[3])
    report = cons.take_report()
    assert report is not None and report.stored == {"c0", "c1"}  # promoted to L1
    if backend == "redis":
        # A flipped byte in Redis is caught by the checksum, even on the L2 path.
        r = redis_server.client()
        cons2, _ = _worker({}, store())
        key = next(k for k in r.keys("kv:*c0:L1"))
        val = bytearray(r.get(key))
        val[-3] ^= 0x01
        r.set(key, bytes(val))
        assert _step(cons2, KVCacheStepMetadata(loads=[ChunkTransfer("c0", [(0, 8)])], chunk_tokens=BS)) == {
            8
        }
        cons2.shutdown()
    prod.shutdown()
    cons.shutdown()


def test_l1_bounded_and_evictions_reported() -> None:
    one_chunk = LAYERS * HEADS * BS * DIM2 * 4
    w, kv = _worker({"l1_capacity_bytes": 3 * one_chunk, "l1_eviction": "lru"})
    _fill(kv, list(range(BLOCKS)))
    evicted: set[str] = set()
    for i in range(BLOCKS):
        _step(w, KVCacheStepMetadata(saves=[ChunkTransfer(f"h{i}", [(0, i)])], chunk_tokens=BS))
        assert w.l1.bytes_used <= 3 * one_chunk
        rep = w.take_report()
        if rep:
            evicted |= rep.evicted
    assert len(w.l1) == 3 and len(evicted) == BLOCKS - 3
    w.shutdown()


def test_failed_load_drops_that_requests_saves() -> None:
    """KV computed over a failed load is wrong; it must never be stored under a valid key."""
    w, kv = _worker({})
    _fill(kv, [1, 2, 3])
    meta = KVCacheStepMetadata(
        loads=[ChunkTransfer("missing", [(0, 4)], "reqA")],
        saves=[ChunkTransfer("a1", [(0, 1)], "reqA"), ChunkTransfer("b1", [(0, 2)], "reqB")],
        chunk_tokens=BS,
    )
    assert _step(w, meta) == {4}
    report = w.take_report()
    assert report is not None
    assert report.failed_reqs == {"reqA"}
    assert report.stored == {"b1"} and "missing" in report.evicted
    assert w.chunk_key("a1") not in w.l1
    w.shutdown()


@pytest.mark.parametrize("l1_checksum", ["sampled", "full", "off"])
def test_l1_checksum_modes_roundtrip_and_detect(l1_checksum: str, tmp_path) -> None:
    flag = tmp_path / "fault"
    w, kv = _worker({"l1_checksum": l1_checksum, "fault_injection_file": str(flag)})
    _fill(kv, [1])
    _step(w, KVCacheStepMetadata(saves=[ChunkTransfer("a", [(0, 1)])], chunk_tokens=BS))
    flag.write_text("zeros")
    errors = _step(w, KVCacheStepMetadata(loads=[ChunkTransfer("a", [(0, 5)])], chunk_tokens=BS))
    # With checks on, zeros are caught and never copied; with them off they get through.
    assert errors == (set() if l1_checksum == "off" else {5})
    flag.unlink()
    assert _step(w, KVCacheStepMetadata(loads=[ChunkTransfer("a", [(0, 6)])], chunk_tokens=BS)) == set()
    assert all(torch.equal(t[6], t[1]) for t in kv.values())
    w.shutdown()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("l1_checksum", ["full", "sampled"])
def test_a_flipped_bit_at_rest_in_l1_fails_only_that_chunk(
    l1_checksum: str, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Damage to a slot's bytes (not the fault hook): the full check, which on CPU hashes each
    chunk right after copying it (chunks shared out over ``threads``), fails exactly that
    chunk; its neighbour still loads."""
    monkeypatch.setattr("kvcache.transfer_engine.host_threads", lambda: threads)
    w, kv = _worker({"l1_checksum": l1_checksum})
    _fill(kv, [1, 2])
    _step(w, KVCacheStepMetadata(saves=[ChunkTransfer("a", [(0, 1)]), ChunkTransfer("b", [(0, 2)])],
                                 chunk_tokens=BS))  # fmt: skip
    slot_b = w.l1.get(w.chunk_key("b")).slot
    # Flip one bit in the middle of layer 1 of chunk b: between two of the sampled check's words.
    raw = w.slab.view(slot_b, 1).view(torch.uint8).view(-1)
    raw[raw.numel() // 2 + 3] ^= 0x10
    errors = _step(w, KVCacheStepMetadata(loads=[ChunkTransfer("a", [(0, 8)]), ChunkTransfer("b", [(0, 9)])],
                                          chunk_tokens=BS))  # fmt: skip
    if l1_checksum == "full":
        assert errors == {9}
    else:  # the documented limit of the sampled check: a bit between samples gets through
        assert errors == set()
    assert all(torch.equal(t[8], t[1]) for t in kv.values())
    w.shutdown()


def test_cpu_pipelined_l1_path_uses_no_threads() -> None:
    """On CPU there is no copy engine: L1 copies run on the compute thread (threads would
    only compete with compute for the same cores)."""
    w, kv = _worker({"mode": "pipelined"})
    _fill(kv, [1, 2])
    _step(w, KVCacheStepMetadata(saves=[ChunkTransfer("a", [(0, 1)]), ChunkTransfer("b", [(0, 2)])],
                                 chunk_tokens=BS))  # fmt: skip
    assert _step(w, KVCacheStepMetadata(loads=[ChunkTransfer("a", [(0, 8)]), ChunkTransfer("b", [(0, 9)])],
                                        chunk_tokens=BS)) == set()  # fmt: skip
    assert all(torch.equal(t[8], t[1]) and torch.equal(t[9], t[2]) for t in kv.values())
    assert not w.engine._io._threads and not w.engine._saver._threads
    w.shutdown()


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
def test_slots_are_never_leaked(eviction: str, tmp_path) -> None:
    """Every slot in use belongs to L1 once writes and loads are done, through saves,
    loads, evictions, failed loads and L2 write-behind."""
    one_chunk = LAYERS * HEADS * BS * DIM2 * 4
    w, kv = _worker(
        {"l1_capacity_bytes": 4 * one_chunk, "l1_eviction": eviction}, FilesystemStore(str(tmp_path))
    )
    _fill(kv, list(range(BLOCKS)))
    for i in range(10):
        _step(w, KVCacheStepMetadata(saves=[ChunkTransfer(f"h{i}", [(0, i)], f"r{i}")], chunk_tokens=BS))
        loads = [ChunkTransfer(f"h{j}", [(0, 12 + j % 4)], "x") for j in range(max(0, i - 5), i)]
        _step(w, KVCacheStepMetadata(loads=loads, chunk_tokens=BS))
    assert w.writer is not None and w.writer.flush()
    assert w.slab is not None and w.slab.slots_in_use == len(w.l1) <= 4
    w.shutdown()


def test_no_free_slot_still_writes_l2(tmp_path) -> None:
    """When every slot is held (e.g. by loads in flight), a save skips L1 but still reaches L2."""
    one_chunk = LAYERS * HEADS * BS * DIM2 * 4
    w, kv = _worker({"l1_capacity_bytes": one_chunk}, FilesystemStore(str(tmp_path)))
    _fill(kv, [1, 2])
    _step(w, KVCacheStepMetadata(saves=[ChunkTransfer("a", [(0, 1)])], chunk_tokens=BS))
    assert w.slab is not None and w.slab.slots_in_use == 1
    w.slab.ref(0)  # a reader still holds chunk a's slot
    _step(w, KVCacheStepMetadata(saves=[ChunkTransfer("b", [(0, 2)])], chunk_tokens=BS))
    assert w.chunk_key("a") not in w.l1 and w.chunk_key("b") not in w.l1
    assert w.writer is not None and w.writer.flush()
    w.slab.unref(0)
    assert w.slab.slots_in_use == 0
    # b comes back from L2 (and is promoted into the now free slot).
    assert _step(w, KVCacheStepMetadata(loads=[ChunkTransfer("b", [(0, 7)])], chunk_tokens=BS)) == set()
    assert all(torch.equal(t[7], t[2]) for t in kv.values())
    assert w.chunk_key("b") in w.l1
    # The promoted copy passes the L1 checks on the next hit.
    assert _step(w, KVCacheStepMetadata(loads=[ChunkTransfer("b", [(0, 8)])], chunk_tokens=BS)) == set()
    assert all(torch.equal(t[8], t[2]) for t in kv.values())
    w.shutdown()


def test_no_free_slot_and_no_l2_skips_the_save() -> None:
    one_chunk = LAYERS * HEADS * BS * DIM2 * 4
    w, kv = _worker({"l1_capacity_bytes": one_chunk})
    _fill(kv, [1, 2])
    _step(w, KVCacheStepMetadata(saves=[ChunkTransfer("a", [(0, 1)])], chunk_tokens=BS))
    assert w.slab is not None
    w.slab.ref(0)  # a reader still holds chunk a's slot
    _step(w, KVCacheStepMetadata(saves=[ChunkTransfer("b", [(0, 2)])], chunk_tokens=BS))
    assert len(w.l1) == 0 and w.take_stats() is not None
    w.slab.unref(0)
    assert w.slab.slots_in_use == 0
    w.shutdown()


class _GarbageStore:
    """An L2 whose records are whatever a hostile or broken writer left."""

    name = "garbage"

    def __init__(self, records: list[object]) -> None:
        self.records = records
        self.i = 0

    def get(self, key: str, max_bytes: int | None = None) -> object:
        self.i += 1
        return self.records[self.i % len(self.records)]

    def put(self, key: str, record: bytes) -> None:
        return None

    def present(self, groups: list[list[str]]) -> list[bool]:
        return [True] * len(groups)

    def close(self) -> None:
        return None


@pytest.mark.parametrize("mode", ["pipelined", "sync"])
def test_malformed_l2_records_are_counted_misses(mode: str) -> None:
    """Nothing an L2 returns reaches the forward as an exception: every load is a miss."""
    import json
    import struct

    hdr = json.dumps({"key": "x", "dtype": "float32", "shape": "bad", "crc32": "z"}).encode()
    records: list[object] = [b"", b"KVC1", b"\x00" * 64, struct.pack("<4sI", b"KVC1", 2) + b"[]",
                             struct.pack("<4sI", b"KVC1", len(hdr)) + hdr, 12345, "text"]  # fmt: skip
    w, kv = _worker({"mode": mode, "l1_capacity_bytes": 0}, _GarbageStore(records))
    before = [t[5].clone() for t in kv.values()]
    loads = [ChunkTransfer("a", [(0, 5)], "r"), ChunkTransfer("b", [(0, 6)], "r")]
    with torch.inference_mode():
        for _ in range(3):
            assert _step(w, KVCacheStepMetadata(loads=loads, chunk_tokens=BS)) == {5, 6}
    assert all(torch.equal(t[5], b) for t, b in zip(kv.values(), before, strict=True))
    stats = w.take_stats()
    assert stats is not None and stats.data.get("miss_integrity") == 6 and "hit_l2" not in stats.data
    w.shutdown()


@pytest.mark.parametrize("mode", ["pipelined", "sync"])
def test_failed_copy_out_is_dropped_not_raised(mode: str, monkeypatch) -> None:
    """An exception while copying a save out stays in the connector: the step stores nothing,
    its slots go back, its requests re-plan their saves, and the next step works."""
    w, kv = _worker({"mode": mode})
    _fill(kv, [1, 2])
    real = StoreJob.gather_layer
    calls = {"n": 0}

    def flaky(step, layer, ready):
        calls["n"] += 1
        if layer == 1:
            raise RuntimeError("copy failed")
        return real(step, layer, ready)

    monkeypatch.setattr(StoreJob, "gather_layer", flaky)
    meta = KVCacheStepMetadata(saves=[ChunkTransfer("a", [(0, 1)], "rA")], chunk_tokens=BS)
    assert _step(w, meta) == set()  # no exception out of save_layer / wait_for_save
    assert calls["n"] >= 2
    report = w.take_report()
    assert report is not None and report.failed_reqs == {"rA"} and not report.stored
    assert w.chunk_key("a") not in w.l1
    assert w.slab is not None and w.slab.slots_in_use == 0
    monkeypatch.setattr(StoreJob, "gather_layer", real)
    _step(w, KVCacheStepMetadata(saves=[ChunkTransfer("b", [(0, 2)], "rB")], chunk_tokens=BS))
    assert w.chunk_key("b") in w.l1
    w.shutdown()


def test_pipeline_stages_never_share_keys(tmp_path) -> None:
    """An even PP split: stage 0 holds layers 0-2, stage 1 layers 3-5, same namespace and
    same local positions. Each stage keys by its global layer numbers, so a chunk one stage
    stored is a miss for the other, never the other stage's KV."""
    stages = []
    for first in (0, LAYERS):
        w = KVCacheWorker(KVCacheSettings.from_extra({"l1_capacity_bytes": 0}), "ns", 0,
                          FilesystemStore(str(tmp_path)))  # fmt: skip
        kv = {
            f"model.layers.{first + i}.self_attn.attn": torch.zeros(BLOCKS, HEADS, BS, DIM2)
            for i in range(LAYERS)
        }
        w.register_kv_caches(kv, BLOCKS, BS)
        stages.append((w, kv))
    (w0, kv0), (w1, kv1) = stages
    _fill(kv0, [1])
    with torch.inference_mode():
        _step(w0, KVCacheStepMetadata(saves=[ChunkTransfer("c", [(0, 1)], "r")], chunk_tokens=BS))
    assert w0.writer is not None and w0.writer.flush()
    names = sorted(p.name for p in tmp_path.rglob("kv_*"))
    assert names == [f"kv_ns_r0_c_L{n}" for n in range(LAYERS)]
    with torch.inference_mode():
        assert _step(w1, KVCacheStepMetadata(loads=[ChunkTransfer("c", [(0, 5)], "r")], chunk_tokens=BS)) == {
            5
        }
        assert (
            _step(w0, KVCacheStepMetadata(loads=[ChunkTransfer("c", [(0, 5)], "r")], chunk_tokens=BS))
            == set()
        )
    assert all(torch.equal(t[5], t[1]) for t in kv0.values())
    w0.shutdown()
    w1.shutdown()


def test_failed_load_drops_saves_by_block_not_by_request() -> None:
    """Hole 1: with vLLM's prefix caching, request B shares block 4 that request A is loading
    in the same step and saves the chunk from it; B's later chunk attended to it. A's load
    fails: both of B's saves must be dropped (never stored under a valid key), an unrelated
    request C's save is kept, and A and B are told to re-plan their saves."""
    w, kv = _worker({})
    _fill(kv, [2, 3])
    meta = KVCacheStepMetadata(
        loads=[ChunkTransfer("p", [(0, 4)], "reqA")],  # absent from every tier: fails
        saves=[
            ChunkTransfer("p", [(0, 4)], "reqB", deps=[4]),  # the shared, unloaded block itself
            ChunkTransfer("q", [(0, 2)], "reqB", deps=[4]),  # computed attending to it
            ChunkTransfer("c", [(0, 3)], "reqC"),
        ],
        chunk_tokens=BS,
    )
    assert _step(w, meta) == {4}
    report = w.take_report()
    assert report is not None
    assert report.failed_reqs == {"reqA", "reqB"}
    assert report.stored == {"c"}
    assert w.chunk_key("p") not in w.l1 and w.chunk_key("q") not in w.l1
    stats = w.take_stats()
    assert stats is not None and stats.data["saves_dropped_failed_load"] == 2
    assert w.slab is not None and w.slab.slots_in_use == 1  # only c's
    # The next step has no failed load: the same saves are stored.
    _fill(kv, [4])
    _step(w, KVCacheStepMetadata(saves=[ChunkTransfer("p", [(0, 4)], "reqB", deps=[4])], chunk_tokens=BS))
    assert w.chunk_key("p") in w.l1
    w.shutdown()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_full_check_values_are_the_slots_checksums_whatever_the_threads(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU full check: chunks with runs and gaps of blocks, copied over ``threads``; every
    check value is the checksum of the slot's bytes (the value an L2 record carries, so a
    promoted or written-behind chunk checks the same), and the loads are exact."""
    monkeypatch.setattr("kvcache.transfer_engine.host_threads", lambda: threads)
    w, kv = _worker({"l1_checksum": "full", "chunk_tokens": 2 * BS})
    _fill(kv, [1, 2, 3, 5, 8, 9])
    saves = [ChunkTransfer("a", [(0, 1), (1, 2)]), ChunkTransfer("b", [(0, 5), (1, 3)]),
             ChunkTransfer("c", [(0, 8), (1, 9)])]  # fmt: skip
    assert _step(w, KVCacheStepMetadata(saves=saves, chunk_tokens=2 * BS)) == set()
    for h in "abc":
        chunk = w.l1.get(w.chunk_key(h))
        assert chunk.sums == [codec.checksum(w.slab.view(chunk.slot, layer)) for layer in range(LAYERS)]
    loads = [ChunkTransfer("a", [(1, 12)]), ChunkTransfer("b", [(0, 13), (1, 10)]),
             ChunkTransfer("c", [(0, 14), (1, 15)])]  # fmt: skip
    assert _step(w, KVCacheStepMetadata(loads=loads, chunk_tokens=2 * BS)) == set()
    for t in kv.values():
        assert torch.equal(t[12], t[2]) and torch.equal(t[13], t[5]) and torch.equal(t[10], t[3])
        assert torch.equal(t[14:16], t[8:10])
    w.shutdown()


def test_a_hostile_fs_tier_is_a_miss_and_the_step_goes_on(tmp_path) -> None:
    """Issue 19, finding 6, through the worker: chunk c0's record replaced by a FIFO, c1's by a
    link to /dev/zero; the step finishes at once, both are recomputed, c2 still loads."""
    import os
    import threading

    prod, kv_p = _worker({}, FilesystemStore(str(tmp_path)))
    _fill(kv_p, [2, 3, 4])
    saves = [ChunkTransfer(c, [(0, b)]) for c, b in (("c0", 2), ("c1", 3), ("c2", 4))]
    with torch.inference_mode():
        _step(prod, KVCacheStepMetadata(saves=saves, chunk_tokens=BS))
    assert prod.writer is not None and prod.writer.flush()
    for path in tmp_path.rglob("*c0_L*"):
        path.unlink()
        os.mkfifo(path)
    for path in tmp_path.rglob("*c1_L*"):
        path.unlink()
        path.symlink_to("/dev/zero")
    cons, kv_c = _worker({}, FilesystemStore(str(tmp_path)))
    loads = [ChunkTransfer("c0", [(0, 10)]), ChunkTransfer("c1", [(0, 11)]), ChunkTransfer("c2", [(0, 12)])]
    failed: list[set[int]] = []

    def load() -> None:
        with torch.inference_mode():  # as in vLLM's forward
            failed.append(_step(cons, KVCacheStepMetadata(loads=loads, chunk_tokens=BS)))

    step = threading.Thread(target=load, daemon=True)
    step.start()
    step.join(30)
    assert not step.is_alive(), "the load step blocked on the hostile tier"
    assert failed == [{10, 11}]  # recomputed by vLLM; never wrong tokens
    assert all(torch.equal(tc[12], tp[4]) for tp, tc in zip(kv_p.values(), kv_c.values(), strict=True))
    prod.shutdown()
    cons.shutdown()
