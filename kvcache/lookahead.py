"""Lookahead prefetch: fetch waiting requests' chunks from L2 into L1 before they are scheduled.

AIBrix's "prefetch the next batches' KV while the current one computes". The scheduler
names, each step, the chunks of the first ``lookahead_requests`` waiting requests that L1 does
not hold (``KVCacheStepMetadata.prefetch``); this fetches them on the engine's I/O threads,
behind the step's compute, and puts them in L1, so the load that comes when the request is
scheduled is a memory copy instead of an L2 read. L1 bounds it: a chunk takes a slot like any
other, evicting the least recently used entry when none is free; slots that a step's load
has pinned are never taken, so the running requests' loads are never disturbed.

Slots and the L1 index are touched only on the compute thread (``submit`` and ``harvest``,
called at each step's start); the fetching thread only fills slots it was handed. It is a
thread of its own, not one of the engine's I/O threads: a step's L2 loads must never queue
behind fetches for requests that are not running yet.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kvcache import metrics
from kvcache.l1_cache import L1Cache
from kvcache.metadata import ChunkTransfer
from kvcache.transfer_engine import LoadFailed, TransferEngine, log_once
from kvcache.transfer_jobs import L1Chunk

log = logging.getLogger(f"vllm.{__name__}")


@dataclass
class _Fetched:
    """One prompt's chunks, fetched in order: the slots filled, and the hashes never filled."""

    kept: list[tuple[str, L1Chunk]]
    not_kept: list[tuple[str, str]]  # (chunk hash, outcome)


class LookaheadLine:
    """Scheduler side: the waiting requests in arrival order, and what was asked of the worker.

    A request joins when vLLM tells the connector of it and leaves when it is scheduled or
    finishes. Each step the first ``depth`` requests name the chunks L1 lacks, once per request;
    a chunk another request asked for is not asked again until the worker reports it."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._waiting: dict[str, list[str]] = {}  # request -> its usable chunk hashes
        # Requests whose chunks were named once: never again (a chunk L2 lacks stays lacking,
        # and asking each step would cost a read per step per waiting request).
        self._named: set[str] = set()
        self._asked: set[str] = set()

    def join(self, req_id: str, hashes: list[str]) -> None:
        if hashes:
            self._waiting[req_id] = hashes

    def leave(self, req_id: str) -> None:
        self._waiting.pop(req_id, None)
        self._named.discard(req_id)

    def lists(self, in_l1: set[str]) -> list[list[str]]:
        lists: list[list[str]] = []
        for n, (req_id, hashes) in enumerate(self._waiting.items()):
            if n >= self.depth:
                break
            if req_id in self._named:
                continue
            self._named.add(req_id)
            want = [h for h in hashes if h not in in_l1 and h not in self._asked]
            if want:
                self._asked.update(want)
                lists.append(want)
        return lists

    def reported(self, hashes: set[str]) -> None:
        if self._asked:
            self._asked -= hashes

    def __bool__(self) -> bool:
        return bool(self._waiting)


def _spare_cpus() -> set[int]:
    """The machine's CPUs that the calling (compute) thread is not bound to; empty when it is
    not bound at all."""
    try:
        compute = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set()
    return set(range(os.cpu_count() or 1)) - compute


def _beside_the_forward(spare: set[int]) -> None:
    """Run the fetching thread off the forward pass's cores when vLLM bound it to some (its CPU
    backend binds the worker to its OpenMP cores, and new threads inherit that): fetching there
    would take its time from the very compute it is meant to run behind."""
    if spare:
        try:
            os.sched_setaffinity(0, spare)
        except OSError:
            pass  # not allowed in this cgroup: stay beside the compute thread


class LookaheadPrefetcher:
    """Worker side: the fetches, and their entry into L1."""

    def __init__(self, engine: TransferEngine, cache: L1Cache) -> None:
        self.engine = engine
        self.cache = cache
        self.enabled = engine.settings.lookahead_requests > 0 and engine.l2 is not None
        self._running: list[Future[_Fetched]] = []
        self._thread = (ThreadPoolExecutor(1, thread_name_prefix="kvcache-lookahead",
                                           initializer=_beside_the_forward, initargs=(_spare_cpus(),))
                        if self.enabled else None)

    def submit(self, lists: list[list[str]]) -> None:
        """Start fetching each list's chunks (one prompt's, in order) on the I/O threads."""
        if self._thread is None or not lists or self.engine.slab is None or not self.engine.kv:
            return
        for hashes in lists:
            plan: list[tuple[str, int]] = []
            skipped: list[tuple[str, str]] = []
            for h in hashes:
                key = self.engine.chunk_key(h)
                slot = None if key in self.cache.index else self.cache.alloc_slot(key)
                if slot is None:
                    skipped.append((h, "skipped" if key in self.cache.index else "no_slot"))
                else:
                    plan.append((h, slot))
            if skipped:
                self._settle(_Fetched([], skipped))
            if plan:
                self._running.append(self._thread.submit(self._fetch, plan))

    def _fetch(self, plan: list[tuple[str, int]]) -> _Fetched:
        """Fetching thread: every layer of each chunk into its slot, stopping at the first chunk L2
        cannot give (the chain's later chunks are not usable without it)."""
        out = _Fetched([], [])
        for i, (h, slot) in enumerate(plan):
            item = ChunkTransfer(h, [])
            try:
                sums = [self.engine.fetch_l2(item, layer, False, slot)[1]
                        for layer in range(self.engine.n_layers)]
            except LoadFailed as exc:
                outcome = "absent" if exc.reason == "absent" else "failed"
            except Exception as exc:  # a tier's surprise must not kill the thread
                log_once("lookahead-error", "kvcache: lookahead fetch of chunk %s failed: %r", h, exc,
                         logger=log)
                outcome = "failed"
            else:
                out.kept.append((h, L1Chunk(slot, sums)))
                continue
            self.engine.slab.unref(slot)  # type: ignore[union-attr]
            out.not_kept.append((h, outcome))
            for later, later_slot in plan[i + 1:]:
                self.engine.slab.unref(later_slot)  # type: ignore[union-attr]
                out.not_kept.append((later, "skipped"))
            break
        return out

    def harvest(self) -> None:
        """Compute thread: put what finished into L1 and report every asked chunk."""
        if not self._running:
            return
        still: list[Future[_Fetched]] = []
        for fut in self._running:
            if fut.done():
                self._settle(fut.result())
            else:
                still.append(fut)
        self._running = still

    def _settle(self, fetched: _Fetched) -> None:
        for h, chunk in fetched.kept:
            if self.cache.keep(self.engine.chunk_key(h), chunk):
                metrics.LOOKAHEAD_CHUNKS.labels("stored").inc()
            else:
                self.engine.slab.unref(chunk.slot)  # type: ignore[union-attr]
                metrics.LOOKAHEAD_CHUNKS.labels("no_slot").inc()
        for _, outcome in fetched.not_kept:
            metrics.LOOKAHEAD_CHUNKS.labels(outcome).inc()
        # Every asked hash is reported (in L1 or not), so the scheduler may ask for it again.
        self.cache.touch([h for h, _ in fetched.kept] + [h for h, _ in fetched.not_kept])

    def close(self) -> None:
        """Wait for the fetches in flight and settle them (their slots go back to the slab)."""
        for fut in self._running:
            try:
                self._settle(fut.result())
            except Exception:  # noqa: BLE001 - shutting down
                pass
        self._running = []
        if self._thread is not None:
            self._thread.shutdown(wait=True)
