"""The L1 slab (preallocated slots, reference counted), run coalescing and the L1 fingerprint."""

from __future__ import annotations

import torch

from kvcache import codec
from kvcache.tiers.l1 import L1Pool
from kvcache.tiers.slab import SlabPool
from kvcache.transfer import HostCopier, PagedLayout, coalesce

SHAPE = (2, 4, 8)  # one block: kv_heads x block_size x 2*head_dim


def _slab(slots: int, segment_slots: int = 2) -> SlabPool:
    slot_bytes = 3 * 2 * 2 * 4 * 8 * 4  # layers x chunk_blocks x block
    return SlabPool(slots * slot_bytes, 3, 2, SHAPE, torch.float32, segment_bytes=segment_slots * slot_bytes)


def test_slots_are_bounded_grow_by_segment_and_are_reused() -> None:
    slab = _slab(5)
    assert slab.max_slots == 5 and slab.segments == []  # nothing reserved until used
    got = [slab.alloc(f"k{i}") for i in range(5)]
    assert got == [0, 1, 2, 3, 4] and slab.alloc("k5") is None  # never beyond capacity
    assert [tuple(s.shape) for s in slab.segments] == [(3, 4, *SHAPE), (3, 4, *SHAPE), (3, 2, *SHAPE)]
    assert slab.bytes_reserved == 5 * slab.slot_bytes
    slab.unref(3)
    slab.unref(1)
    assert slab.owner(1) is None and slab.alloc("again") == 1  # lowest free slot first
    assert slab.owner(1) == "again"


def test_a_referenced_slot_is_not_reused() -> None:
    slab = _slab(1)
    s = slab.alloc("a")
    assert s is not None
    slab.ref(s)  # e.g. a queued L2 write
    slab.unref(s)  # L1 evicts it
    assert slab.alloc("b") is None  # still read by the writer
    slab.unref(s)  # the write is done
    assert slab.alloc("b") == s


def test_views_are_distinct_and_consecutive_slots_are_contiguous() -> None:
    slab = _slab(4)
    for i in range(4):
        slab.alloc(f"k{i}")
    for slot in range(4):
        for layer in range(3):
            slab.view(slot, layer).fill_(slot * 10 + layer)
    for slot in range(4):
        for layer in range(3):
            assert torch.all(slab.view(slot, layer) == slot * 10 + layer)
    base0, row0 = slab.rows(0, 1)
    base1, row1 = slab.rows(1, 1)
    assert base0 is base1 and row1 == row0 + 2  # same segment, next rows


def test_l1_pool_reports_every_dropped_value() -> None:
    dropped: list[tuple[str, int]] = []
    pool: L1Pool[int] = L1Pool(300, "lru", on_drop=lambda k, v: dropped.append((k, v)))
    for i, k in enumerate("abc"):
        pool.put(k, i, 100)
    pool.put("a", 9, 100)  # replaced
    pool.put("d", 3, 100)  # evicts b (LRU)
    assert pool.evict_one() == "c"
    seen: list[int] = []
    assert pool.get("d", on_hit=seen.append) == 3 and seen == [3]
    pool.clear()
    assert dropped == [("a", 0), ("b", 1), ("c", 2), ("a", 9), ("d", 3)]


def test_coalesce_merges_runs_consecutive_on_both_sides() -> None:
    a, b = torch.zeros(8, 2), torch.zeros(8, 2)
    moves = [(a, 2, 7), (a, 0, 5), (a, 1, 6), (b, 0, 8), (a, 3, 9), (b, 1, 9)]
    runs = {(h is a, r, blk, n) for h, r, blk, n in coalesce(moves)}
    assert runs == {(True, 0, 5, 3), (True, 3, 9, 1), (False, 0, 8, 2)}


def test_host_copier_gathers_and_scatters_runs() -> None:
    kv = torch.randn(12, *SHAPE)
    layout = PagedLayout.detect(kv, 12)
    host = torch.zeros(6, *SHAPE)
    c = HostCopier()
    c.gather_rows(kv, layout, [(host, i, b) for i, b in enumerate([3, 4, 5, 9, 1, 2])])
    assert torch.equal(host, kv[[3, 4, 5, 9, 1, 2]])
    kv2 = torch.zeros_like(kv)
    c.scatter_rows(kv2, layout, [(host, i, b) for i, b in enumerate([6, 7, 8, 0, 10, 11])])
    assert torch.equal(kv2[[6, 7, 8, 0, 10, 11]], host)


def test_fingerprint_catches_zeroed_and_changed_memory() -> None:
    t = torch.randn(4, *SHAPE)
    fp = codec.fingerprint(t)
    assert codec.fingerprint(t.clone()) == fp
    assert codec.fingerprint(torch.zeros_like(t)) != fp
    other = t.clone()
    other.view(-1)[0] += 1.0  # a sampled word
    assert codec.fingerprint(other) != fp
    assert codec.fingerprint(torch.randn(4, *SHAPE)) != fp  # another chunk's bytes
