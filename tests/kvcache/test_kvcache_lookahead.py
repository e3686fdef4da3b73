"""Lookahead prefetch without vLLM: the scheduler names waiting requests' chunks, the worker
fetches them from a real L2 (the filesystem tier) into L1 behind the step, and the load that
follows is an L1 copy with the producer's bytes. The end-to-end measurement against vLLM is
``test_kvcache_lookahead_vllm.py``."""

from __future__ import annotations

import shutil
import time
from types import SimpleNamespace

import pytest
import torch
from test_kvcache_worker import BS, DIM2, HEADS, LAYERS, _step, _worker

from kvcache import metrics
from kvcache.config import KVCacheSettings
from kvcache.keys import KeyNamespace, chunk_hashes
from kvcache.metadata import ChunkTransfer, KVCacheStepMetadata, KVCacheWorkerReport
from kvcache.scheduler import KVCacheScheduler
from kvcache.tiers import FilesystemStore
from kvcache.worker import KVCacheWorker

ONE_CHUNK = LAYERS * HEADS * BS * DIM2 * 4


def _produce(tmp_path, hashes: list[str]) -> dict[str, torch.Tensor]:
    """A producer saves one block per chunk to L2; its paged cache, to compare against."""
    prod, kv = _worker({}, FilesystemStore(str(tmp_path)))
    for i, t in enumerate(kv.values()):
        for b in range(len(hashes)):
            t[b] = torch.randn(HEADS, BS, DIM2) + i
    with torch.inference_mode():
        _step(prod, KVCacheStepMetadata(saves=[ChunkTransfer(h, [(0, b)]) for b, h in enumerate(hashes)],
                                        chunk_tokens=BS))  # fmt: skip
    assert prod.writer is not None and prod.writer.flush()
    prod.shutdown()
    return kv


def _reports_until(w: KVCacheWorker, wanted: set[str], timeout_s: float = 10.0) -> KVCacheWorkerReport:
    """Reports (one per engine step) until each wanted hash was reported, in L1 or not."""
    seen = KVCacheWorkerReport()
    deadline = time.monotonic() + timeout_s
    while not wanted <= seen.stored | seen.evicted:
        assert time.monotonic() < deadline, f"not reported: {wanted - seen.stored - seen.evicted}"
        report = w.take_report()
        if report is not None:
            seen.stored |= report.stored
            seen.evicted |= report.evicted
        time.sleep(0.01)
    return seen


def _hits(tier: str) -> float:
    return metrics.HITS.labels(tier)._value.get()


def test_prefetched_chunks_are_in_l1_with_the_producers_bytes(tmp_path) -> None:
    kv_p = _produce(tmp_path, ["c0", "c1", "c2", "c3"])
    w, kv = _worker({"lookahead_requests": 4}, FilesystemStore(str(tmp_path)))
    with torch.inference_mode():
        # A prompt's chunks in order; "zz" is not in L2, so "c3" after it is not fetched.
        _step(w, KVCacheStepMetadata(prefetch=[["c0", "c1"], ["c2", "zz", "c3"]], chunk_tokens=BS))
        seen = _reports_until(w, {"c0", "c1", "c2", "zz", "c3"})
        assert seen.stored == {"c0", "c1", "c2"} and seen.evicted == {"zz", "c3"}
        l1, l2 = _hits("l1"), _hits("l2")
        loads = [ChunkTransfer(h, [(0, 10 + i)], "r") for i, h in enumerate(["c0", "c1", "c2"])]
        assert _step(w, KVCacheStepMetadata(loads=loads, chunk_tokens=BS)) == set()
    assert (_hits("l1") - l1, _hits("l2") - l2) == (3, 0)
    for tp, tc in zip(kv_p.values(), kv.values(), strict=True):
        assert all(torch.equal(tc[10 + b], tp[b]) for b in range(3))
    w.shutdown()
    assert w.slab is not None and w.slab.slots_in_use == len(w.l1) == 3


def test_without_lookahead_the_same_load_reads_l2(tmp_path) -> None:
    _produce(tmp_path, ["c0", "c1"])
    w, _ = _worker({}, FilesystemStore(str(tmp_path)))
    assert not w.lookahead.enabled
    with torch.inference_mode():
        _step(w, KVCacheStepMetadata(prefetch=[["c0", "c1"]], chunk_tokens=BS))  # ignored: off
        time.sleep(0.2)
        assert w.take_report() is None
        l1, l2 = _hits("l1"), _hits("l2")
        loads = [ChunkTransfer(h, [(0, 10 + i)], "r") for i, h in enumerate(["c0", "c1"])]
        assert _step(w, KVCacheStepMetadata(loads=loads, chunk_tokens=BS)) == set()
    assert (_hits("l1") - l1, _hits("l2") - l2) == (0, 2)
    w.shutdown()


def test_a_prefetch_never_takes_the_slot_of_a_chunk_the_step_is_loading(tmp_path) -> None:
    """L1 of two slots, both full; the step loads "a", which only L1 still holds, while three
    chunks are prefetched: they may evict "a" from the index but not take its slot before the
    load has copied it, so the load gets the right bytes."""
    l2_dir = tmp_path / "l2"
    kv_ab = _produce(l2_dir, ["a", "b"])
    w, kv = _worker({"lookahead_requests": 4, "l1_capacity_bytes": 2 * ONE_CHUNK, "l1_eviction": "lru"},
                    FilesystemStore(str(l2_dir)))  # fmt: skip
    with torch.inference_mode():
        first = [ChunkTransfer("b", [(0, 8)], "r0"), ChunkTransfer("a", [(0, 9)], "r0")]
        assert _step(w, KVCacheStepMetadata(loads=first, chunk_tokens=BS)) == set()
        assert w.slab is not None and len(w.l1) == 2
        shutil.rmtree(l2_dir)  # from now on "a" is in L1 only
        _produce(l2_dir, ["p0", "p1", "p2"])
        meta = KVCacheStepMetadata(loads=[ChunkTransfer("a", [(0, 12)], "r1")], prefetch=[["p0", "p1", "p2"]],
                                   chunk_tokens=BS)  # fmt: skip
        assert _step(w, meta) == set()
        _reports_until(w, {"p0", "p1", "p2"})
    for tp, tc in zip(kv_ab.values(), kv.values(), strict=True):
        assert torch.equal(tc[12], tp[0])
    assert w.slab.slots_in_use == len(w.l1) <= 2
    w.shutdown()


# -- the scheduler side ----------------------------------------------------------------------
NS = KeyNamespace(
    model="m@", dtype="torch.float32", block_size=BS, chunk_tokens=BS, num_layers=LAYERS,
    kv_heads=2, head_size=8, kv_layout="cpu/None/FullAttentionSpec", tp_size=1,
)  # fmt: skip
STEP = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                       num_scheduled_tokens={})  # fmt: skip


def _prompt(seed: int, chunks: int) -> list[int]:
    return [seed * 1000 + i for i in range(chunks * BS + 1)]  # the last token is always computed


def test_scheduler_names_the_first_waiting_requests_chunks_once(tmp_path) -> None:
    sched = KVCacheScheduler(KVCacheSettings.from_extra({"lookahead_requests": 2}), NS, BS,
                             FilesystemStore(str(tmp_path)))  # fmt: skip
    for r, chunks in (("r1", 2), ("r2", 3), ("r3", 1)):
        sched.on_new_request(r, _prompt(int(r[1]), chunks))
    h1, h2, h3 = (chunk_hashes(NS, _prompt(i, c)) for i, c in ((1, 2), (2, 3), (3, 1)))
    sched.l1_index.add(h2[0])  # already in L1: not asked
    assert sched.build_meta(STEP, {}).prefetch == [h1, h2[1:]]
    # Asked once: not again until the worker reports on them.
    assert sched.build_meta(STEP, {}).prefetch == []
    # r1 is scheduled: the line moves up to r3.
    new = SimpleNamespace(req_id="r1", block_ids=None, prompt_token_ids=[], mm_features=None,
                          prompt_embeds=None, num_computed_tokens=0)  # fmt: skip
    step = SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                           num_scheduled_tokens={})  # fmt: skip
    assert sched.build_meta(step, {}).prefetch == [h3]
    # A request is named once: a chunk reported absent from L2 is not asked again for it.
    sched.on_worker_report(KVCacheWorkerReport(evicted={h2[2]}))
    assert sched.build_meta(STEP, {}).prefetch == []
    # ... but a new request naming it asks again (L2 may hold it by now).
    sched.on_new_request("r4", _prompt(2, 3))
    assert sched.build_meta(STEP, {}).prefetch == []  # r4 is third in line, past the depth of 2
    sched.finished("r2")
    assert sched.build_meta(STEP, {}).prefetch == [[h2[2]]]  # r4 (same prompt as r2) moved up
    sched.finished("r3")
    sched.finished("r4")
    assert sched.build_meta(STEP, {}).prefetch == []


def test_scheduler_lookahead_is_off_by_default_and_without_l2(tmp_path) -> None:
    off = KVCacheScheduler(KVCacheSettings(), NS, BS, FilesystemStore(str(tmp_path)))
    no_l2 = KVCacheScheduler(KVCacheSettings.from_extra({"lookahead_requests": 2}), NS, BS, None)
    for sched in (off, no_l2):
        sched.on_new_request("r1", _prompt(1, 2))
        assert sched.line.depth == 0 and sched.build_meta(STEP, {}).prefetch == []


@pytest.mark.service
def test_an_l2_outage_during_a_prefetch_loses_no_slot_and_a_later_prefetch_stores(redis_server) -> None:
    """Redis killed before the fetch: the chunks are reported not stored (counted failed), every
    slot goes back. Redis back (empty: it keeps nothing on disk) and written again, the next
    prefetch gets them into L1 with the producer's bytes."""
    from kvcache.tiers import RedisStore

    def store() -> RedisStore:
        return RedisStore(redis_server.url, timeout_s=0.5, retry_s=0.0)

    def produce() -> dict[str, torch.Tensor]:
        prod, kv_p = _worker({}, store())
        for t in kv_p.values():
            t[0], t[1] = torch.randn(HEADS, BS, DIM2), torch.randn(HEADS, BS, DIM2)
        saves = [ChunkTransfer("c0", [(0, 0)]), ChunkTransfer("c1", [(0, 1)])]
        with torch.inference_mode():
            _step(prod, KVCacheStepMetadata(saves=saves, chunk_tokens=BS))
        assert prod.writer is not None and prod.writer.flush()
        prod.shutdown()
        return kv_p

    produce()
    w, kv = _worker({"lookahead_requests": 2}, store())
    failed = metrics.LOOKAHEAD_CHUNKS.labels("failed")._value.get()
    redis_server.stop()
    with torch.inference_mode():
        _step(w, KVCacheStepMetadata(prefetch=[["c0", "c1"]], chunk_tokens=BS))
        seen = _reports_until(w, {"c0", "c1"})
        assert seen.stored == set() and w.slab is not None and w.slab.slots_in_use == 0
        assert metrics.LOOKAHEAD_CHUNKS.labels("failed")._value.get() - failed == 1  # then c1 skipped
        redis_server.start()
        kv_p = produce()
        _step(w, KVCacheStepMetadata(prefetch=[["c0", "c1"]], chunk_tokens=BS))
        assert _reports_until(w, {"c0", "c1"}).stored == {"c0", "c1"}
        l1 = _hits("l1")
        load = KVCacheStepMetadata(loads=[ChunkTransfer("c1", [(0, 9)], "r")], chunk_tokens=BS)
        assert _step(w, load) == set()
    assert _hits("l1") - l1 == 1
    assert all(torch.equal(tc[9], tp[1]) for tp, tc in zip(kv_p.values(), kv.values(), strict=True))
    w.shutdown()
