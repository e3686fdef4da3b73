"""Failed loads, and the saves they poison, by block id.

KV computed over a failed load is wrong, so it may never be stored under a valid key. A
failed chunk's blocks are reported to vLLM (``take_errors``: it recomputes them, with
``kv_load_failure_policy=recompute``), and that step's saves are dropped when their own
blocks or the blocks they attended to (``ChunkTransfer.deps``) failed to load, or when
their request's load failed. With vLLM's prefix caching another request may share those
very blocks in the same step, which is why the rule goes by block id, not only by request
(docs/kvcache.md, *Integrity*). Requests whose load failed or whose saves were dropped
re-plan their saves (``take_reqs``, sent up in the worker's report).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvcache.metadata import ChunkTransfer


class FailedLoads:
    """This step's failed loads, and what is still to be reported about past ones."""

    def __init__(self) -> None:
        # Requests whose load failed this step: the KV they computed this step attended
        # to blocks that were not loaded, so none of it may be saved.
        self._step_reqs: set[str] = set()
        # Block ids whose load failed this step. With vLLM's prefix caching another request
        # may share those very blocks (or attend to them) in the same step, so saves are
        # invalidated by block, not only by the request whose load failed.
        self._step_blocks: set[int] = set()
        self._reqs: set[str] = set()  # to report: requests that re-plan their saves
        self._errors: set[int] = set()  # to report: blocks vLLM recomputes
        self._lock = threading.Lock()

    def record(self, blocks: set[int], reqs: set[str]) -> None:
        """The failed blocks and requests of this step's (finished) loads."""
        if blocks:
            with self._lock:
                self._errors |= blocks
        self._step_reqs = reqs
        self._step_blocks = blocks

    def poisoned(self, items: list[ChunkTransfer]) -> set[int]:
        """Saves (indices) whose KV may come from a failed load of this step: the chunk's
        own blocks were to be loaded, or its request attended to such blocks (``deps``), or
        it is a request whose load failed. They are never stored."""
        failed_reqs, bad_blocks = self._step_reqs, self._step_blocks
        out: set[int] = set()
        for idx, item in enumerate(items):
            if item.req_id in failed_reqs or (
                bad_blocks
                and (any(b in bad_blocks for _, b in item.blocks) or any(b in bad_blocks for b in item.deps))
            ):
                out.add(idx)
        return out

    def end_step(self, replan: Iterable[str] = ()) -> None:
        """The step's saves are settled: its failed requests and ``replan`` (requests whose
        saves were dropped) re-plan their saves; the next step starts clean."""
        failed, self._step_reqs = self._step_reqs, set()
        self._step_blocks = set()
        with self._lock:
            self._reqs |= failed | set(replan)

    def take_errors(self) -> set[int]:
        with self._lock:
            out, self._errors = self._errors, set()
        return out

    def take_reqs(self) -> set[str]:
        with self._lock:
            out, self._reqs = self._reqs, set()
        return out
