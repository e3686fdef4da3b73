import threading

import pytest

from kvcache.tiers.l1 import L1Pool


@pytest.mark.parametrize("policy", ["s3fifo", "lru"])
def test_never_exceeds_capacity(policy: str) -> None:
    pool: L1Pool[int] = L1Pool(1000, policy)
    evicted = 0
    for i in range(500):
        evicted += len(pool.put(f"k{i}", i, 30 + i % 70))
        assert pool.bytes_used <= 1000
    assert evicted > 0 and pool.evictions == evicted
    assert len(pool) < 500


@pytest.mark.parametrize("policy", ["s3fifo", "lru"])
def test_oversized_entry_refused(policy: str) -> None:
    pool: L1Pool[str] = L1Pool(100, policy)
    pool.put("a", "x", 50)
    assert pool.put("big", "y", 101) == []
    assert "big" not in pool and pool.get("a") == "x"


def test_lru_evicts_least_recently_used() -> None:
    pool: L1Pool[int] = L1Pool(300, "lru")
    for k in "abc":
        pool.put(k, 0, 100)
    pool.get("a")
    assert pool.put("d", 0, 100) == ["b"]


def test_s3fifo_keeps_hot_entries_under_a_scan() -> None:
    pool: L1Pool[int] = L1Pool(1000, "s3fifo")
    for k in ("hot1", "hot2"):
        pool.put(k, 1, 100)
        pool.get(k)
    # A stream of one-hit entries (distinct prompts) passes through the small queue.
    for i in range(100):
        pool.put(f"scan{i}", 0, 100)
        pool.get("hot1")
        pool.get("hot2")
    assert "hot1" in pool and "hot2" in pool
    assert pool.bytes_used <= 1000


def test_s3fifo_ghost_readmits_to_main() -> None:
    pool: L1Pool[int] = L1Pool(1000, "s3fifo")
    pool.put("x", 0, 100)
    for i in range(20):
        pool.put(f"s{i}", 0, 100)
    assert "x" not in pool
    pool.put("x", 0, 100)  # remembered in the ghost list: goes to main
    for i in range(20, 25):
        pool.put(f"s{i}", 0, 100)
    assert "x" in pool


def test_replace_updates_bytes() -> None:
    pool: L1Pool[int] = L1Pool(1000, "s3fifo")
    pool.put("a", 1, 400)
    pool.put("a", 2, 100)
    assert pool.bytes_used == 100 and pool.get("a") == 2


def test_thread_safe_under_concurrent_puts() -> None:
    pool: L1Pool[int] = L1Pool(5000, "s3fifo")

    def work(t: int) -> None:
        for i in range(2000):
            pool.put(f"{t}-{i}", i, 10 + i % 90)
            pool.get(f"{t}-{i // 2}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert pool.bytes_used <= 5000
    # bytes_used must equal the sum of what is really stored
    assert pool.bytes_used == sum(e.nbytes for e in list(pool._small.values()) + list(pool._main.values()))
