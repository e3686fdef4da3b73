"""Prefix affinity: send a request to the instance that most recently took the same prompt prefix.

An instance that served a prefix still holds its KV (vLLM's prefix cache, kvcache's L1), so
the next request with that prefix is computed there from the first token that differs. The
router cannot see those caches; like AIBrix's prefix-cache router and llm-d's approximate
prefix scorer it remembers where it sent each prefix:

* **Blocks.** The request body's raw bytes from the ``"messages"`` key (chat) or ``"prompt"``
  (completions), in blocks of ``BLOCK_BYTES``, hashed chained (block k's hash covers every
  byte up to its end), seeded with the model and ``cache_salt`` (another salt never shares
  KV). No tokenizer, as in ``batch/prefixes.py`` (which hashes the same bytes at validation;
  its module needs numpy and the store, which the router image does not carry): equal byte
  prefixes are equal token prefixes up to about a block. Only whole blocks count, at most
  ``MAX_BLOCKS`` (64 KiB): deeper matches rarely change the choice and would cost time.
* **Index.** Per role, a bounded LRU map block hash → the last few instances that took it
  (newest first). A lookup walks the request's blocks from the first while the map knows
  them; each instance's match length is the deepest block it holds.
* **Choice.** The healthy instance with the longest match, unless its load score exceeds the
  least-loaded instance's by more than ``slack`` (default 8, AIBrix's default imbalance of 8
  running requests): then the next-longest match, else least-loaded. Whatever is chosen is
  recorded for all the request's blocks, so a prefix that overflows one instance spreads to
  a second one, which then holds it too.

Collisions and stale entries (an instance restarted, a prefix evicted) cost only a less
useful choice, never a wrong answer: every instance computes what it does not hold.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from .backends import Backend, BackendPool

BLOCK_BYTES = 512
MAX_BLOCKS = 128
# Instances remembered per block: a hot prefix spread over several instances keeps them all.
HOLDERS = 4
DEFAULT_ENTRIES = 200_000  # ~40 MB of index at most (tracemalloc); ~100 MB of prompt bytes remembered
DEFAULT_SLACK = 8.0

HIT, MISS, OVERLOADED = "hit", "miss", "overloaded"


def prefix_blocks(raw: bytes, body: dict[str, Any]) -> list[int]:
    """Chained hashes of the whole ``BLOCK_BYTES`` blocks of the request's prompt text."""
    start = raw.find(b'"messages"')
    if start < 0:
        start = raw.find(b'"prompt"')
        if start < 0:
            return []
    n = min((len(raw) - start) // BLOCK_BYTES, MAX_BLOCKS)
    if n <= 0:
        return []
    h = hash((str(body.get("model")), str(body.get("cache_salt"))))
    out = []
    for k in range(start, start + n * BLOCK_BYTES, BLOCK_BYTES):
        h = hash((h, raw[k : k + BLOCK_BYTES]))
        out.append(h)
    return out


class PrefixIndex:
    """Bounded LRU map: block hash → the instances (URLs, newest first) that took it."""

    def __init__(self, capacity: int = DEFAULT_ENTRIES) -> None:
        if capacity < 1:
            raise ValueError(f"prefix index capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._map: OrderedDict[int, tuple[str, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def match(self, blocks: list[int]) -> dict[str, int]:
        """Instance URL → number of leading blocks it holds (only instances holding >= 1)."""
        depth: dict[str, int] = {}
        get = self._map.get
        for i, h in enumerate(blocks, 1):
            urls = get(h)
            if urls is None:
                break  # chained hashes: nothing deeper can match
            for url in urls:
                depth[url] = i
        return depth

    def record(self, blocks: list[int], url: str) -> None:
        m = self._map
        for h in blocks:
            urls = m.get(h)
            if urls is None:
                m[h] = (url,)
                continue
            if urls[0] != url:
                m[h] = (url, *(u for u in urls if u != url))[:HOLDERS]
            m.move_to_end(h)
        # The least recently used blocks go first: deep blocks of one-off prompts before the
        # shallow blocks every request of a group touches again.
        while len(m) > self.capacity:
            m.popitem(last=False)


class PrefixAffinity:
    """The affinity choice for both roles, on top of ``BackendPool.pick``."""

    def __init__(self, capacity: int = DEFAULT_ENTRIES, slack: float = DEFAULT_SLACK) -> None:
        if slack < 0:
            raise ValueError(f"prefix affinity slack must be >= 0, got {slack}")
        self.slack = slack
        self.capacity = capacity
        self._indexes: dict[str, PrefixIndex] = {}

    def index(self, role: str) -> PrefixIndex:
        idx = self._indexes.get(role)
        if idx is None:
            idx = self._indexes[role] = PrefixIndex(self.capacity)
        return idx

    def pick(
        self,
        pool: BackendPool,
        role: str,
        blocks: list[int],
        prefer_pod_set: str | None = None,
        exclude: set[str] | None = None,
    ) -> tuple[Backend | None, str | None]:
        """(the instance, the affinity outcome: HIT / MISS / OVERLOADED, None without blocks)."""
        fallback = pool.pick(role, prefer_pod_set, exclude)
        if fallback is None or not blocks:
            return fallback, None
        index = self.index(role)
        depth = index.match(blocks)
        chosen, outcome = fallback, MISS
        if depth:
            limit = fallback.score() + self.slack
            holders = [
                b for b in pool.backends
                if b.url in depth and b.role == role and b.healthy and not (exclude and b.url in exclude)
            ]  # fmt: skip
            holders.sort(key=lambda b: (-depth[b.url], b.score()))
            outcome = OVERLOADED if holders else MISS
            for b in holders:
                if b.score() <= limit:
                    chosen, outcome = b, HIT
                    break
        index.record(blocks, chosen.url)
        return chosen, outcome
