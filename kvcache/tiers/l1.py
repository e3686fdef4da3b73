"""L1: a bounded CPU memory pool of KV chunks.

Capacity is in bytes and is never exceeded: an insert first evicts until the new entry
fits, and an entry bigger than the whole pool is refused. Two policies:

- ``lru``: classic least-recently-used.
- ``s3fifo``: S3-FIFO (Yang et al., SOSP'23). New entries enter a small FIFO (10% of the
  bytes); entries read again before they leave it are promoted to the main FIFO, the rest
  are evicted and remembered in a ghost list so that a quick re-insert goes straight to
  main. One-hit wonders (a stream of distinct prompts) thus never push out hot prefixes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")

_MAX_FREQ = 3


@dataclass
class _Entry(Generic[V]):
    value: V
    nbytes: int
    freq: int = 0


class L1Pool(Generic[V]):
    """Thread-safe byte-bounded cache; ``put`` returns the keys it evicted.

    ``on_drop(key, value)`` runs (under the pool's lock) for every value that leaves the
    pool: evicted, replaced or cleared; the worker uses it to release the value's slot.
    """

    def __init__(
        self, capacity_bytes: int, policy: str = "s3fifo", on_drop: Callable[[str, V], None] | None = None
    ) -> None:
        if policy not in ("s3fifo", "lru"):
            raise ValueError(f"unknown eviction policy {policy!r}")
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self._on_drop = on_drop
        self._lock = threading.Lock()
        # lru uses only _main (ordered oldest first). s3fifo uses _small, _main and _ghost.
        self._small: OrderedDict[str, _Entry[V]] = OrderedDict()
        self._main: OrderedDict[str, _Entry[V]] = OrderedDict()
        self._ghost: OrderedDict[str, None] = OrderedDict()
        self._small_bytes = 0
        self._main_bytes = 0
        self.evictions = 0

    # -- reads -------------------------------------------------------------------------
    def get(self, key: str, on_hit: Callable[[V], None] | None = None) -> V | None:
        """The value (counted as a use), or None. ``on_hit(value)`` runs under the lock,
        so a caller can take a reference before any eviction can drop the value."""
        with self._lock:
            entry = self._small.get(key) or self._main.get(key)
            if entry is None:
                return None
            if self.policy == "lru":
                self._main.move_to_end(key)
            else:
                entry.freq = min(entry.freq + 1, _MAX_FREQ)
            if on_hit is not None:
                on_hit(entry.value)
            return entry.value

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._small or key in self._main

    def __len__(self) -> int:
        with self._lock:
            return len(self._small) + len(self._main)

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._small_bytes + self._main_bytes

    # -- writes ------------------------------------------------------------------------
    def put(self, key: str, value: V, nbytes: int) -> list[str]:
        """Insert (or replace) ``key``; returns evicted keys. Oversized entries are refused."""
        evicted: list[str] = []
        with self._lock:
            self._remove(key)
            if nbytes > self.capacity_bytes:
                return evicted
            while self._small_bytes + self._main_bytes + nbytes > self.capacity_bytes:
                victim = self._evict_one()
                if victim is None:
                    break
                evicted.append(victim)
            if nbytes > self.capacity_bytes - self._small_bytes - self._main_bytes:
                return evicted  # cannot fit (only when nothing is left to evict)
            entry = _Entry(value, nbytes)
            if self.policy == "lru" or key in self._ghost:
                self._ghost.pop(key, None)
                self._main[key] = entry
                self._main_bytes += nbytes
            else:
                self._small[key] = entry
                self._small_bytes += nbytes
            self.evictions += len(evicted)
        return evicted

    def evict_one(self) -> str | None:
        """Evict one entry by the policy (to free its memory for a new one); its key or None."""
        with self._lock:
            victim = self._evict_one()
            if victim is not None:
                self.evictions += 1
            return victim

    def clear(self) -> None:
        with self._lock:
            if self._on_drop is not None:
                for key, entry in [*self._small.items(), *self._main.items()]:
                    self._on_drop(key, entry.value)
            self._small.clear()
            self._main.clear()
            self._ghost.clear()
            self._small_bytes = self._main_bytes = 0

    # -- internals (lock held) ---------------------------------------------------------
    def _remove(self, key: str) -> None:
        entry = self._small.pop(key, None)
        if entry is not None:
            self._small_bytes -= entry.nbytes
            self._dropped(key, entry)
        entry = self._main.pop(key, None)
        if entry is not None:
            self._main_bytes -= entry.nbytes
            self._dropped(key, entry)

    def _dropped(self, key: str, entry: _Entry[V]) -> None:
        if self._on_drop is not None:
            self._on_drop(key, entry.value)

    def _evict_one(self) -> str | None:
        if self.policy == "lru":
            if not self._main:
                return None
            key, entry = self._main.popitem(last=False)
            self._main_bytes -= entry.nbytes
            self._dropped(key, entry)
            return key
        small_target = self.capacity_bytes // 10
        while self._small or self._main:
            if self._small and (self._small_bytes > small_target or not self._main):
                key, entry = self._small.popitem(last=False)
                self._small_bytes -= entry.nbytes
                if entry.freq > 0:
                    # Read again while on probation: promote, it is worth keeping.
                    entry.freq = 0
                    self._main[key] = entry
                    self._main_bytes += entry.nbytes
                    continue
                self._ghost[key] = None
                # The ghost list holds keys only; bound it by entry count.
                while len(self._ghost) > max(16, len(self._small) + len(self._main)):
                    self._ghost.popitem(last=False)
                self._dropped(key, entry)
                return key
            key, entry = self._main.popitem(last=False)
            if entry.freq > 0:
                entry.freq -= 1
                self._main[key] = entry  # second chance: back to the head
                continue
            self._main_bytes -= entry.nbytes
            self._dropped(key, entry)
            return key
        return None
