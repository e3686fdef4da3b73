"""Prefix warm-up: a prefix group's first request is answered before the rest of the group is sent.

A grouped shard (split in prefix order, ``batch/grouped_split.py``: it has a ``.lines`` file)
holds each group of requests that share a prompt prefix back to back, the first of the group
first. Sent ``concurrency`` at a time, the whole group would reach the server at once and
every request would compute the shared prefix itself, since none of them finds it cached
yet. ``WarmupGate`` hands the shard's requests to the workers instead and parks a group's
followers until its first request (the *leader*) is answered, or ``wait_s`` after it was
handed out, whichever comes first; meanwhile the workers take the next requests of the shard
(other groups), so one group's wait never holds up another's requests.

Groups are found again from the lines themselves, with the hashes validation used
(``batch/prefixes.py``: chained hashes of the first 256, 1024, 4096 and 16384 bytes of the
``messages``/``prompt``/``input`` JSON): a request is in the run of the line before it at
every level where both hashes agree. Only runs sharing at least ``LEVELS[MIN_LEVEL]`` bytes
hold requests back (a shorter shared prefix is not worth a round trip), and a nested run
waits for its own leader (a template's first question waits for the common header's first
request, the template's other questions for that first question).

Memory: at most ``max_parked`` parked requests (parsed lines); past that a follower is sent
without waiting. Every request is handed out exactly once, parked or not.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from aibrix_operators.batch.prefixes import LEVELS

# LEVELS[1] = 1024 bytes (~250 tokens): the shortest shared prefix a follower waits for.
MIN_LEVEL = 1
DEFAULT_WAIT_S = 5.0


class Leader:
    """The first request of a run: its answer (or its time-out) releases the followers."""

    __slots__ = ("done", "followers", "handed_at", "timer")

    def __init__(self) -> None:
        self.done = False
        self.followers: list[tuple[dict[str, Any], Leader | None]] = []
        # When a worker took it (None while it is itself parked behind a shallower leader):
        # the wait bound counts from here.
        self.handed_at: float | None = None
        self.timer: asyncio.TimerHandle | None = None


class WarmupGate:
    """Hands a grouped shard's requests to workers, a group's followers after its leader."""

    def __init__(
        self,
        items: Iterator[tuple[dict[str, Any], tuple[int, ...]]],
        wait_s: float = DEFAULT_WAIT_S,
        max_parked: int = 4096,
    ) -> None:
        self._items = items
        self.wait_s = wait_s
        self.max_parked = max_parked
        self._exhausted = False
        self._prev: tuple[int, ...] = (0,) * len(LEVELS)
        self._leaders: list[Leader | None] = [None] * len(LEVELS)
        self._ready: deque[tuple[dict[str, Any], Leader | None]] = deque()
        self._wake = asyncio.Event()
        self.parked = 0
        # For the log line at the end.
        self.held = 0  # followers that waited for a leader
        self.timed_out = 0  # leaders whose followers were released by the wait bound

    async def next(self) -> tuple[dict[str, Any], Leader | None] | None:
        """The next request to send, with the ``Leader`` it opens (pass it to ``answered``);
        None when every request has been handed out."""
        while True:
            if self._ready:
                return self._hand(self._ready.popleft())
            if not self._exhausted:
                item = next(self._items, None)
                if item is None:
                    self._exhausted = True
                    continue
                record, hashes = item
                wait_for, own = self._place(hashes)
                if wait_for is not None and not wait_for.done and self.parked < self.max_parked:
                    self._park(wait_for, record, own)
                    continue
                return self._hand((record, own))
            if not self.parked:
                return None
            self._wake.clear()
            await self._wake.wait()

    def answered(self, leader: Leader | None) -> None:
        """The request that opened ``leader`` has its answer: send its followers."""
        if leader is not None:
            self._release(leader)

    def _place(self, hashes: tuple[int, ...]) -> tuple[Leader | None, Leader | None]:
        """(the leader this request waits for, the leader it is itself for deeper runs)."""
        prev, leaders = self._prev, self._leaders
        self._prev = hashes
        depth = 0
        while depth < len(hashes) and hashes[depth] and hashes[depth] == prev[depth]:
            depth += 1
        wait_for = leaders[depth - 1] if depth > MIN_LEVEL else None
        own = None
        # Runs it starts: the levels below its shared depth, down to MIN_LEVEL.
        if depth < len(hashes) and hashes[max(depth, MIN_LEVEL)]:
            own = Leader()
        for level in range(depth, len(hashes)):
            leaders[level] = own if hashes[level] else None
        return wait_for, own

    def _hand(self, item: tuple[dict[str, Any], Leader | None]) -> tuple[dict[str, Any], Leader | None]:
        own = item[1]
        if own is not None:
            own.handed_at = time.monotonic()
            if own.followers:
                self._arm(own)
        return item

    def _park(self, leader: Leader, record: dict[str, Any], own: Leader | None) -> None:
        if leader.handed_at is not None and leader.timer is None:
            self._arm(leader)
        leader.followers.append((record, own))
        self.parked += 1
        self.held += 1

    def _arm(self, leader: Leader) -> None:
        assert leader.handed_at is not None
        delay = max(0.0, leader.handed_at + self.wait_s - time.monotonic())
        leader.timer = asyncio.get_running_loop().call_later(delay, self._time_out, leader)

    def _time_out(self, leader: Leader) -> None:
        if not leader.done:
            self.timed_out += 1
        self._release(leader)

    def _release(self, leader: Leader) -> None:
        if leader.done:
            return
        leader.done = True
        if leader.timer is not None:
            leader.timer.cancel()
        if leader.followers:
            self._ready.extend(leader.followers)
            self.parked -= len(leader.followers)
            leader.followers = []
            self._wake.set()
