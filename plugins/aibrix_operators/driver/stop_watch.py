"""A shard's part in its batch's stop rules (``batch/stop_rules.py``): publish, sum, stop.

Every ``stop_poll_s`` the driver writes its shard's tally (answers, own errors, tokens) under the
run's stop prefix, lists the prefix, and sums the other shards' latest tallies with its own live
counts; between those rounds it judges its live counts with the others' as last read, every
``LOCAL_S``. A rule tripped on that sum, or the stop marker another shard wrote, stops this shard
through its cancel watch (no new request or attempt; unanswered requests end ``batch_stopped``).
The first shard to trip writes the marker; two that trip together write the same rule's figures,
either is right.

Costs: nothing per request (the workers read the cancel watch's flag as before); per round one PUT,
one LIST and a GET for each other running shard (a shard's last tally, marked final, is read once),
so ``running shards²`` GETs a round over the batch. What the rules see of the other shards is up to
one round old, and a request already in flight when a rule trips is still answered: a batch can go
past its budget by what the running shards answer in ``LOCAL_S`` plus one round of the others'.
A resumed shard counts its earlier answers from its result log and their tokens from its last
published tally, so tokens answered after that tally but before the shard was lost are not counted
(at most one round's worth).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from aibrix_operators.batch.stop_rules import (
    MARKER_NAME,
    StopReason,
    StopRules,
    StopTally,
    marker_uri,
    tally_uri,
)
from aibrix_operators.driver.cancel import CancelWatch
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.storage import Storage

log = logging.getLogger(__name__)

# How often the shard's own live counts are judged (with the others' as last read): no I/O, so a
# budget or an error rate this shard trips stops it within this, not within a round with the store.
LOCAL_S = 0.5


class StopWatch:
    def __init__(self, storage: Storage, prefix: str, shard: str, rules: StopRules, cancel: CancelWatch,
                 poll_s: float, own: Callable[[], StopTally]) -> None:
        self.storage = storage
        self.prefix = prefix
        self.shard = shard
        self.rules = rules
        self.cancel = cancel
        self.poll_s = poll_s
        self.own = own  # this run's live tally (the runner's counters)
        self.base = StopTally()  # what earlier runs of this shard answered
        self._final: dict[str, StopTally] = {}  # other shards' last tallies, read once
        self._others = StopTally()  # the other shards' sum at the last round with the store

    def resume(self, answered: int, own_errors: int) -> None:
        """Count an earlier run's answers (from the result log) and its last published tokens."""
        earlier = StopTally(answered=answered, own_errors=own_errors)
        try:
            raw = self.storage.read_bytes(tally_uri(self.prefix, self.shard))
            published = StopTally.from_dict(json.loads(raw))
        except Exception:  # noqa: BLE001 - none yet, or unreadable: its tokens count as nothing
            published = StopTally()
        earlier.input_tokens, earlier.output_tokens = published.input_tokens, published.output_tokens
        self.base = earlier

    def tally(self) -> StopTally:
        total = StopTally()
        total.add(self.base)
        total.add(self.own())
        return total

    def publish(self, final: bool = False) -> None:
        data = self.tally().as_dict() | {"final": final}
        self.storage.write_bytes(tally_uri(self.prefix, self.shard), json.dumps(data).encode())

    def judge(self) -> StopReason | None:
        """The rules on this shard's live counts and the others' as last read (no I/O)."""
        batch = self.tally()
        batch.add(self._others)
        return self.rules.verdict(batch)

    def check(self) -> StopReason | None:
        """One round with the store (blocking I/O: run it in a thread): publish, read the others,
        judge; a trip writes the marker."""
        self.publish()
        others = StopTally()
        mine = tally_uri(self.prefix, self.shard).rsplit("/", 1)[-1]
        for uri in self.storage.list(self.prefix):
            name = uri.rsplit("/", 1)[-1]
            if name == MARKER_NAME:
                return StopReason.from_bytes(self.storage.read_bytes(uri))
            if name == mine or not name.endswith(".json"):
                continue
            if name in self._final:
                others.add(self._final[name])
                continue
            try:
                data = json.loads(self.storage.read_bytes(uri))
            except Exception:  # noqa: BLE001 - being rewritten, or gone: counted next round
                continue
            other = StopTally.from_dict(data)
            if isinstance(data, dict) and data.get("final") is True:
                self._final[name] = other
            others.add(other)
        self._others = others
        reason = self.judge()
        if reason is not None:
            self.storage.write_bytes(marker_uri(self.prefix), reason.to_bytes())
        return reason

    async def run(self) -> None:
        """Judge the live counts every ``LOCAL_S`` (nothing read), the store every ``poll_s``."""
        last_round = time.monotonic()
        while True:
            await asyncio.sleep(min(LOCAL_S, self.poll_s))
            try:
                if time.monotonic() - last_round >= self.poll_s:
                    last_round = time.monotonic()
                    reason = await asyncio.to_thread(self.check)
                elif (reason := self.judge()) is not None:
                    marker = marker_uri(self.prefix)
                    await asyncio.to_thread(self.storage.write_bytes, marker, reason.to_bytes())
            except Exception as exc:  # noqa: BLE001 - a store hiccup must not fail the shard
                log.warning("%s: cannot check the batch's stop rules (%s); will look again", self.shard, exc)
                continue
            if reason is not None:
                self.cancel.stop(reason)
                return


def shard_stop_watch(storage: Storage, config: DriverConfig, shard: str, cancel: CancelWatch, resumed: int,
                     resumed_failed: int, own: Callable[[], StopTally]) -> StopWatch | None:
    """The batch's stop rules for one shard's run, or None when the batch has none. ``resumed``,
    ``resumed_failed``: the answers (and error lines) earlier runs left in the result log."""
    rules = config.stop_rules
    if rules is None or not rules.active or config.stop_prefix is None:
        return None
    watch = StopWatch(storage, config.stop_prefix, shard, rules, cancel, config.stop_poll_s, own)
    watch.resume(resumed, resumed_failed)
    return watch
