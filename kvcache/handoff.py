"""Prefill → decode handoff through the shared tier: what the producer promises, and how
long the consumer waits for it.

The producer saves a prompt's chunks to L2 behind the request (a write-behind queue, so a
save never stalls compute), and vLLM answers the prefill call as soon as its one token is
out: the decode call can arrive before the chunks are stored. So the producer's
``request_finished`` returns ``kv_transfer_params`` naming what it stores (vLLM's P/D
convention: ``do_remote_prefill`` for the decode side, plus a ``kvcache`` entry), the router
passes them to the decode call, and the consumer's lookup is *pending* (vLLM's
``get_num_new_matched_tokens`` → ``None``: "ask again next step"; the scheduler thread
never blocks) until L2 holds those chunks or ``handoff_wait_s`` has passed. After the
timeout the lookup loads whatever leading chunks are stored and the rest is recomputed:
a lost handoff costs time, never tokens.

The ``kvcache`` entry carries the number of chunks and the hash of the last one. Keys are
content hashes chained from the namespace and the request's ``cache_salt``, so the
consumer recomputes the same hash for the same prompt under the same model, layout and
salt; a mismatch (another model, another salt, a client's made-up params) means there is
nothing to wait for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PARAMS_KEY = "kvcache"
_HASH_CHARS = 32  # keys.chunk_hashes: 16-byte blake2b digests, hex


@dataclass(frozen=True)
class Handoff:
    """What a producer stored (or queued) for one request: chunks [0, chunks) of its prompt."""

    chunks: int
    last_hash: str

    def to_params(self) -> dict[str, Any]:
        """``kv_transfer_params`` for the decode call (returned in the prefill response)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            PARAMS_KEY: {"chunks": self.chunks, "last_hash": self.last_hash},
        }

    @classmethod
    def from_params(cls, params: Any) -> Handoff | None:
        """The handoff a decode call carries, or None (none, or malformed: no wait)."""
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        entry = params.get(PARAMS_KEY)
        if not isinstance(entry, dict):
            return None
        chunks, last = entry.get("chunks"), entry.get("last_hash")
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks <= 0:
            return None
        if not isinstance(last, str) or len(last) != _HASH_CHARS:
            return None
        return cls(chunks, last)


@dataclass
class _Wait:
    deadline: float
    next_poll: float


class HandoffWaits:
    """Per-request wait state of a consumer: when to look at L2 again, when to give up.

    Pure bookkeeping (the caller does the L2 lookup), with an injectable clock for tests.
    """

    def __init__(self, timeout_s: float, poll_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.clock = clock
        self._waits: dict[str, _Wait] = {}
        self._resolved: set[str] = set()

    def wanted(self, req_id: str) -> bool:
        """Whether this request may still wait (each request waits at most once: a request
        preempted and looked up again, or one that timed out, never waits again)."""
        return req_id not in self._resolved

    def poll_due(self, req_id: str) -> bool:
        """True when the caller should look at L2 now; starts the wait on the first call.
        Between polls the caller answers "pending" without a round trip."""
        now = self.clock()
        wait = self._waits.get(req_id)
        if wait is None:
            self._waits[req_id] = _Wait(now + self.timeout_s, now)
            return True
        return now >= wait.next_poll or now >= wait.deadline

    def keep_waiting(self, req_id: str) -> bool:
        """After a poll that found the handoff incomplete: True to stay pending, False once
        the deadline has passed (the caller then resolves it as whatever is stored)."""
        wait = self._waits.get(req_id)
        now = self.clock()
        if wait is None or now >= wait.deadline:
            return False
        wait.next_poll = now + self.poll_s
        return True

    def resolve(self, req_id: str) -> None:
        self._waits.pop(req_id, None)
        self._resolved.add(req_id)

    def waited_s(self, req_id: str) -> float:
        wait = self._waits.get(req_id)
        return 0.0 if wait is None else self.clock() - (wait.deadline - self.timeout_s)

    def forget(self, req_id: str) -> None:
        self._waits.pop(req_id, None)
        self._resolved.discard(req_id)

    def __len__(self) -> int:
        return len(self._waits)
