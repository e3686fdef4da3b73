"""Scheduler side: decides what to load and what to save, and says so in step metadata.

It never touches KV bytes. It knows what L1 holds from the worker's reports (chunks
stored / evicted) and asks L2 whether a chunk's records exist. A wrong guess is safe:
the worker reports the blocks it could not load and vLLM recomputes them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvcache import metrics
from kvcache.config import KVCacheSettings
from kvcache.handoff import Handoff, HandoffWaits
from kvcache.keys import KeyNamespace, chunk_hashes, storage_key
from kvcache.lookahead import LookaheadLine
from kvcache.metadata import ChunkTransfer, KVCacheStepMetadata, KVCacheWorkerReport
from kvcache.tiers import L2Store, TierUnavailable

# Under "vllm." so that records reach the handlers vLLM configures in its processes.
log = logging.getLogger(f"vllm.{__name__}")


@dataclass
class _ReqState:
    """What the scheduler tracks for one running request."""

    hashes: list[str]  # chained hashes of the prompt's full chunks
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int = 0  # chunks [0, saved_upto) are stored or queued to be


@dataclass
class _PendingLoad:
    hashes: list[str]
    num_external_tokens: int


class KVCacheScheduler:
    def __init__(
        self,
        settings: KVCacheSettings,
        namespace: KeyNamespace,
        block_size: int,
        l2: L2Store | None,
        can_load: bool = True,
        can_save: bool = True,
        layer_ids: list[int] | None = None,
    ) -> None:
        self.settings = settings
        self.namespace = namespace
        self.ns = namespace.prefix()
        self.block_size = block_size
        self.chunk = namespace.chunk_tokens
        self.blocks_per_chunk = self.chunk // block_size
        self.l2 = l2
        self.can_load = can_load
        self.can_save = can_save
        # Global layer numbers whose keys a lookup checks (this process's stage's layers).
        self.layer_ids = list(layer_ids) if layer_ids is not None else list(range(namespace.num_layers))
        self.l1_index: set[str] = set()
        self._hash_cache: dict[str, list[str]] = {}
        self._pending_loads: dict[str, _PendingLoad] = {}
        self._reqs: dict[str, _ReqState] = {}
        self.handoffs = HandoffWaits(settings.handoff_wait_s, settings.handoff_poll_s)
        # Resolved handoffs not yet sent to the worker side (step metadata).
        self._handoff_events: list[tuple[str, float]] = []
        # Lookahead prefetch (kvcache/lookahead.py); depth 0: off.
        self.line = LookaheadLine(settings.lookahead_requests if can_load and l2 is not None else 0)

    # -- lookup ----------------------------------------------------------------------------
    def _hashes(
        self, req_id: str, prompt: list[int], salt: str | None = None, adapter: str | None = None
    ) -> list[str]:
        cached = self._hash_cache.get(req_id)
        if cached is None:
            cached = chunk_hashes(self.namespace, prompt, salt=salt, adapter=adapter)
            self._hash_cache[req_id] = cached
        return cached

    def num_matched_tokens(
        self,
        req_id: str,
        prompt: list[int],
        num_computed_tokens: int,
        salt: str | None = None,
        handoff: Handoff | None = None,
        adapter: str | None = None,
    ) -> int | None:
        """Tokens beyond ``num_computed_tokens`` whose KV we can load (side-effect free for vLLM).

        Also where a request's chunk hashes are made, under its ``cache_salt`` and LoRA
        ``adapter`` identity: vLLM asks this of every new request, and the step metadata
        (which lacks the salt) reuses them.

        ``handoff``: what a prefill instance stored for this prompt (kvcache.handoff). Until
        L2 holds it, or ``handoff_wait_s`` passes, the answer is None ("pending": vLLM skips
        the request this step and asks again).
        """
        if not prompt:
            return 0
        hashes = self._hashes(req_id, prompt, salt, adapter)
        if not self.can_load:
            return 0
        # Leave at least one prompt token to compute: vLLM needs logits for it.
        usable = min(len(hashes), (len(prompt) - 1) // self.chunk)
        expected = self._handoff_chunks(req_id, hashes, usable, handoff, num_computed_tokens)
        if expected and not self.handoffs.poll_due(req_id):
            return None
        hit, reachable = self._leading_hits(hashes[:usable])
        if expected:
            if hit < expected and reachable and self.handoffs.keep_waiting(req_id):
                return None
            outcome = "complete" if hit >= expected else "timeout" if reachable else "unavailable"
            self._handoff_events.append((outcome, self.handoffs.waited_s(req_id)))
            if outcome != "complete":
                log.info(
                    "kvcache: request %s: prefill handoff of %d chunks incomplete (%s), %d found; "
                    "recomputing the rest",
                    req_id, expected, outcome, hit,
                )  # fmt: skip
            self.handoffs.resolve(req_id)
        metrics.SCHED_QUERY_TOKENS.inc(max(0, len(prompt) - num_computed_tokens))
        matched = max(0, hit * self.chunk - num_computed_tokens)
        metrics.SCHED_HIT_TOKENS.inc(matched)
        return matched

    def _handoff_chunks(
        self, req_id: str, hashes: list[str], usable: int, handoff: Handoff | None, num_computed: int
    ) -> int:
        """How many leading chunks to wait for (0: no wait)."""
        if handoff is None or self.l2 is None or not self.handoffs.wanted(req_id):
            return 0
        if self.settings.handoff_wait_s <= 0:
            return 0
        if handoff.chunks > len(hashes) or hashes[handoff.chunks - 1] != handoff.last_hash:
            # Not this prompt under this namespace and salt: nothing of ours to wait for.
            self._handoff_events.append(("mismatch", 0.0))
            self.handoffs.resolve(req_id)
            return 0
        expected = min(handoff.chunks, usable)
        if num_computed >= expected * self.chunk:
            # vLLM's own prefix cache already holds all of it: nothing to wait for.
            self.handoffs.resolve(req_id)
            return 0
        return expected

    def _leading_hits(self, hashes: list[str]) -> tuple[int, bool]:
        """Leading chunks stored in L1 or L2, and whether L2 answered (False: it is down)."""
        n = 0
        while n < len(hashes) and hashes[n] in self.l1_index:
            n += 1
        rest = hashes[n:]
        if not rest or self.l2 is None:
            return n, True
        groups = [[storage_key(self.ns, 0, h, layer) for layer in self.layer_ids] for h in rest]
        try:
            found = self.l2.present(groups)
        except TierUnavailable:
            metrics.L2_ERRORS.labels("lookup").inc()
            return n, False
        for h, ok in zip(rest, found, strict=True):
            if not (ok or h in self.l1_index):
                break
            n += 1
        return n, True

    # -- lookahead prefetch ----------------------------------------------------------------
    def on_new_request(
        self, req_id: str, prompt: list[int], salt: str | None = None, adapter: str | None = None
    ) -> None:
        """A request joined vLLM's waiting queue: its chunk hashes, made now (lookup reuses them),
        put it in line for lookahead prefetch."""
        if self.line.depth and prompt:
            hashes = self._hashes(req_id, prompt, salt, adapter)
            self.line.join(req_id, hashes[: (len(prompt) - 1) // self.chunk])

    def handoff(self, req_id: str) -> Handoff | None:
        """Producer side, when a request finishes: the chunks it stored or queued for L2
        (None if it stored none). Decode instances wait for them (``num_matched_tokens``)."""
        state = self._reqs.get(req_id)
        if state is None or not self.can_save or state.saved_upto <= 0:
            return None
        n = min(state.saved_upto, len(state.hashes))
        return Handoff(n, state.hashes[n - 1])

    def after_alloc(self, req_id: str, prompt: list[int], num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._pending_loads[req_id] = _PendingLoad(self._hashes(req_id, prompt), num_external_tokens)

    # -- per step --------------------------------------------------------------------------
    def build_meta(self, scheduler_output: Any, requests: dict[str, Any]) -> KVCacheStepMetadata:
        """Loads for newly scheduled requests, saves for every chunk completed this step."""
        meta = KVCacheStepMetadata(chunk_tokens=self.chunk, handoffs=self._handoff_events)
        self._handoff_events = []
        queued: set[str] = set()
        for new in scheduler_output.scheduled_new_reqs:
            self.line.leave(new.req_id)
            block_ids = list(new.block_ids[0]) if new.block_ids else []
            prompt = list(new.prompt_token_ids or [])
            hashes = self._hash_cache.get(new.req_id)
            # No hashes: the request was never looked up (or its LoRA adapter could not be
            # fingerprinted), so its salt or adapter is unknown; better not stored than
            # stored under the base model's unsalted keys.
            if not self._cacheable(new) or not prompt or hashes is None:
                continue
            state = _ReqState(hashes, block_ids)
            self._reqs[new.req_id] = state
            pending = self._pending_loads.pop(new.req_id, None)
            if pending is not None:
                self._add_load(meta, new.req_id, state, new.num_computed_tokens, pending.num_external_tokens)
            computed_after = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(
                new.req_id, 0
            )
            self._add_saves(meta, new.req_id, state, computed_after, queued)

        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            pending = self._pending_loads.pop(req_id, None)
            if pending is not None:  # a preempted request resumed with an external hit
                self._add_load(
                    meta, req_id, state, cached.num_computed_tokens[i], pending.num_external_tokens
                )
            computed_after = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(
                req_id, 0
            )
            self._add_saves(meta, req_id, state, computed_after, queued)
        # Anything still pending was not scheduled after all; it will be asked again.
        self._pending_loads.clear()
        self._add_deps(meta)
        if self.line:
            meta.prefetch = self.line.lists(self.l1_index)
        return meta

    def _add_deps(self, meta: KVCacheStepMetadata) -> None:
        """Tell each save which of this step's loaded blocks its request reads. With vLLM's
        prefix caching a request can share blocks another request is loading in this very
        step; if that load fails, the worker must drop these saves too (by block, not by
        request), or the unloaded blocks' bytes would be stored under valid keys."""
        loaded = {b for item in meta.loads for _, b in item.blocks}
        if not loaded:
            return
        deps: dict[str, list[int]] = {}
        for item in meta.saves:
            if item.req_id not in deps:
                state = self._reqs.get(item.req_id)
                deps[item.req_id] = sorted(loaded.intersection(state.block_ids)) if state else []
            item.deps = deps[item.req_id]

    def _cacheable(self, new: Any) -> bool:
        # Our keys cover token ids (and the LoRA adapter, in the chain root): multimodal
        # inputs and prompt embeddings change the KV for the same ids, so such requests
        # bypass the cache.
        return not (new.mm_features or new.prompt_embeds is not None)

    def _add_load(
        self, meta: KVCacheStepMetadata, req_id: str, state: _ReqState, num_computed: int, num_external: int
    ) -> None:
        first_token = num_computed - num_external
        first_block = first_token // self.block_size
        last_block = num_computed // self.block_size  # exclusive
        for c in range(first_block // self.blocks_per_chunk, last_block // self.blocks_per_chunk):
            blocks = []
            for j in range(self.blocks_per_chunk):
                b = c * self.blocks_per_chunk + j
                if first_block <= b < last_block:
                    blocks.append((j, state.block_ids[b]))
            meta.loads.append(ChunkTransfer(state.hashes[c], blocks, req_id))
        # Loaded chunks are stored already: never save them again.
        state.saved_upto = max(state.saved_upto, last_block // self.blocks_per_chunk)

    def _add_saves(
        self, meta: KVCacheStepMetadata, req_id: str, state: _ReqState, computed_after: int, queued: set[str]
    ) -> None:
        if not self.can_save:
            return
        done = min(len(state.hashes), computed_after // self.chunk)
        while state.saved_upto < done:
            c = state.saved_upto
            h = state.hashes[c]
            first = c * self.blocks_per_chunk
            if (
                h not in self.l1_index
                and h not in queued
                and first + self.blocks_per_chunk <= len(state.block_ids)
            ):
                blocks = [(j, state.block_ids[first + j]) for j in range(self.blocks_per_chunk)]
                meta.saves.append(ChunkTransfer(h, blocks, req_id))
                queued.add(h)
            state.saved_upto += 1

    # -- feedback --------------------------------------------------------------------------
    def on_worker_report(self, report: KVCacheWorkerReport | None) -> None:
        if report is None:
            return
        self.l1_index -= report.evicted
        self.l1_index |= report.stored
        self.line.reported(report.stored | report.evicted)
        for req_id in report.failed_reqs:
            state = self._reqs.get(req_id)
            if state is not None:
                # vLLM rewinds the request to its first failed block and recomputes from
                # there; the chunks it recomputes must be saved (stored ones are skipped).
                state.saved_upto = 0

    def finished(self, req_id: str) -> None:
        self.line.leave(req_id)
        self.handoffs.forget(req_id)
        self._reqs.pop(req_id, None)
        self._hash_cache.pop(req_id, None)
        self._pending_loads.pop(req_id, None)
