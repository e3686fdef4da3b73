"""CPU chunk copies with the check of every byte (``kvcache.host_copy``), on real arrays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache import codec
from kvcache.host_copy import ChunkCopier, chunk_copy, host_array, host_threads


def test_host_array_views_any_dtype_without_copying() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        t = torch.zeros(3, 4, dtype=dtype)
        a = host_array(t)
        a[1, :] = 0xFF  # writes through: it is the tensor's memory
        assert t.view(torch.uint8)[1].eq(0xFF).all() and t.view(torch.uint8)[0].eq(0).all()
        assert codec.checksum_bytes(a) == codec.checksum(t)


def test_chunk_copy_moves_runs_both_ways() -> None:
    blocks = np.arange(10 * 6, dtype=np.uint8).reshape(10, 6)
    rows = np.zeros((8, 6), dtype=np.uint8)
    # Rows 0-1 from blocks 4-5 (one run), row 2 from block 9, rows 0-2 of a slot at row 3.
    c = chunk_copy(blocks, rows, 3, [(0, 4), (1, 5), (2, 9)], 3, into_kv=False)
    assert len(c.pairs) == 2
    [value] = ChunkCopier(1).run([c])
    assert (rows[3:5] == blocks[4:6]).all() and (rows[5] == blocks[9]).all() and not rows[:3].any()
    assert value == codec.checksum_bytes(np.ascontiguousarray(rows[3:6]))
    back = np.zeros_like(blocks)
    ChunkCopier(1).run([chunk_copy(back, rows, 3, [(1, 0), (2, 7)], 3, into_kv=True)])
    assert (back[0] == blocks[5]).all() and (back[7] == blocks[9]).all()
    assert back[[1, 2, 3, 4, 5, 6, 8, 9]].sum() == 0


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_copier_keeps_the_order_of_its_results(threads: int) -> None:
    rng = np.random.default_rng(threads)
    src = rng.integers(0, 256, size=(7, 2, 4096), dtype=np.uint8)
    # Chunk i is rows 2i..2i+1 of dst: row 2i gets block i, row 2i+1 stays zero.
    dst = np.zeros((14, 2, 4096), dtype=np.uint8)
    copies = [chunk_copy(src, dst, 2 * i, [(0, i)], 2, into_kv=False) for i in range(7)]
    copier = ChunkCopier(threads)
    values = copier.run(copies)
    copier.shutdown()
    assert values == [codec.checksum_bytes(np.ascontiguousarray(dst[2 * i : 2 * i + 2])) for i in range(7)]
    assert all((dst[2 * i] == src[i]).all() and not dst[2 * i + 1].any() for i in range(7))
    assert len(set(values)) == 7


def test_a_failing_copy_raises_after_every_share_is_done() -> None:
    good_src = np.ones((4, 1024), dtype=np.uint8)
    good_dst = np.zeros_like(good_src)
    bad = chunk_copy(np.ones((4, 3), dtype=np.uint8), np.zeros((4, 5), dtype=np.uint8), 0, [(0, 0)], 1, False)
    copies = [bad] + [chunk_copy(good_src, good_dst, i, [(0, i)], 1, into_kv=False) for i in range(4)]
    copier = ChunkCopier(2)
    with pytest.raises(ValueError):
        copier.run(copies)
    assert good_dst[2:].all()  # the other thread's share ran to its end before the error came back
    copier.shutdown()


def test_host_threads_never_exceeds_the_cores_this_thread_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert host_threads() == 1  # a vLLM CPU worker bound to one core copies inline
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert host_threads() == 3
