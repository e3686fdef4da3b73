"""The P/D handoff's scheduler logic, without vLLM: what a producer names when a prefill
finishes, and a consumer's pending lookup (None = "ask again") until L2 holds those chunks,
or its timeout, after which it is a miss for what is absent (recompute, never wrong KV).

L2 is a real FilesystemStore; time is a fake clock so the deadline is exact.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvcache.config import KVCacheSettings
from kvcache.handoff import Handoff
from kvcache.keys import KeyNamespace, storage_key
from kvcache.scheduler import KVCacheScheduler
from kvcache.tiers import FilesystemStore, TierUnavailable

BS = 4
LAYERS = 2
NS = KeyNamespace(
    model="m@", dtype="torch.float32", block_size=BS, chunk_tokens=BS, num_layers=LAYERS,
    kv_heads=2, head_size=8, kv_layout="cpu/None/FullAttentionSpec", tp_size=1,
)  # fmt: skip
PROMPT = list(range(100, 100 + 4 * BS + 1))  # 4 full chunks + 1 token: all 4 loadable


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class CountingStore(FilesystemStore):
    """The real filesystem tier, counting lookups (a pending request must not poll L2 on
    every engine step) and able to go down."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.lookups = 0
        self.down = False

    def present(self, groups: list[list[str]]) -> list[bool]:
        self.lookups += 1
        if self.down:
            raise TierUnavailable("down")
        return super().present(groups)


def _scheduler(
    store: FilesystemStore | None, *, wait_s: float = 2.0, poll_s: float = 0.01, **roles: bool
) -> tuple[KVCacheScheduler, Clock]:
    settings = KVCacheSettings.from_extra({"handoff_wait_s": wait_s, "handoff_poll_s": poll_s})
    sched = KVCacheScheduler(settings, NS, BS, store, **roles)
    clock = Clock()
    sched.handoffs.clock = clock
    return sched, clock


def _store_chunks(store: FilesystemStore, sched: KVCacheScheduler, req_id: str, chunks: range) -> None:
    hashes = sched._hash_cache[req_id]
    for c in chunks:
        for layer in range(LAYERS):
            store.put(storage_key(sched.ns, 0, hashes[c], layer), b"record")


_EMPTY_STEP = SimpleNamespace(
    scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]), num_scheduled_tokens={}
)


def _outcomes(sched: KVCacheScheduler) -> list[str]:
    """Handoffs resolved since the last step, as the next step's metadata carries them to
    the worker side (which counts them in kvcache_handoffs_total)."""
    return [outcome for outcome, _ in sched.build_meta(_EMPTY_STEP, {}).handoffs]


def _producer_handoff(tmp_path) -> Handoff:
    """A producer prefills PROMPT (one scheduler step) and finishes: what it names."""
    sched, _ = _scheduler(FilesystemStore(str(tmp_path / "p")), can_load=False)
    assert sched.num_matched_tokens("p1", PROMPT, 0) == 0
    new = SimpleNamespace(
        req_id="p1", block_ids=([10, 11, 12, 13, 14],), prompt_token_ids=PROMPT, num_computed_tokens=0,
        mm_features=None, lora_request=None, prompt_embeds=None,
    )  # fmt: skip
    out = SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
        num_scheduled_tokens={"p1": len(PROMPT)},
    )
    meta = sched.build_meta(out, {})
    assert [s.chunk_hash for s in meta.saves] == sched._hash_cache["p1"]
    handoff = sched.handoff("p1")
    assert handoff is not None
    sched.finished("p1")
    return handoff


def test_producer_names_what_it_stored_and_params_round_trip(tmp_path) -> None:
    handoff = _producer_handoff(tmp_path)
    consumer, _ = _scheduler(None)
    hashes = consumer._hashes("x", PROMPT)
    assert handoff == Handoff(4, hashes[3])  # the same content hash on another instance
    params = handoff.to_params()
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert Handoff.from_params(params) == handoff
    # What vLLM adds to the params on the way (remote_prefill_cached_tokens) is harmless.
    assert Handoff.from_params({**params, "remote_prefill_cached_tokens": 0}) == handoff


@pytest.mark.parametrize(
    "params",
    [
        None,
        {},
        {"do_remote_prefill": True},  # NIXL-style params: not ours, no wait
        {"do_remote_prefill": False, "kvcache": {"chunks": 4, "last_hash": "a" * 32}},
        {"do_remote_prefill": True, "kvcache": {"chunks": "4", "last_hash": "a" * 32}},
        {"do_remote_prefill": True, "kvcache": {"chunks": 0, "last_hash": "a" * 32}},
        {"do_remote_prefill": True, "kvcache": {"chunks": True, "last_hash": "a" * 32}},
        {"do_remote_prefill": True, "kvcache": {"chunks": 4, "last_hash": 7}},
        {"do_remote_prefill": True, "kvcache": ["chunks", 4]},
    ],
)
def test_malformed_or_foreign_params_mean_no_wait(params) -> None:
    assert Handoff.from_params(params) is None


def test_pending_until_l2_holds_the_handoff_then_every_chunk_loads(tmp_path) -> None:
    handoff = _producer_handoff(tmp_path)
    store = CountingStore(str(tmp_path / "l2"))
    sched, clock = _scheduler(store)
    assert _outcomes(sched) == []
    assert sched.num_matched_tokens("d1", PROMPT, 0, handoff=handoff) is None  # nothing stored yet
    _store_chunks(store, sched, "d1", range(2))  # the write-behind has stored half
    lookups = store.lookups
    clock.t += 0.001  # before the next poll is due: pending without touching L2
    assert sched.num_matched_tokens("d1", PROMPT, 0, handoff=handoff) is None
    assert store.lookups == lookups
    clock.t += 0.01
    assert sched.num_matched_tokens("d1", PROMPT, 0, handoff=handoff) is None  # 2 of 4: still pending
    assert store.lookups == lookups + 1
    _store_chunks(store, sched, "d1", range(2, 4))
    clock.t += 0.01
    assert sched.num_matched_tokens("d1", PROMPT, 0, handoff=handoff) == 4 * BS  # the whole handoff
    assert _outcomes(sched) == ["complete"]
    # vLLM may ask again (e.g. the request was preempted): answered at once, no new wait.
    assert sched.num_matched_tokens("d1", PROMPT, BS, handoff=handoff) == 3 * BS
    assert len(sched.handoffs) == 0


def test_timeout_is_a_miss_for_what_never_arrived(tmp_path) -> None:
    handoff = _producer_handoff(tmp_path)
    store = CountingStore(str(tmp_path / "l2"))
    sched, clock = _scheduler(store, wait_s=2.0)
    assert _outcomes(sched) == []
    assert sched.num_matched_tokens("d2", PROMPT, 0, handoff=handoff) is None
    _store_chunks(store, sched, "d2", range(1))  # only the first chunk ever arrives
    for _ in range(10):
        clock.t += 0.19
        assert sched.num_matched_tokens("d2", PROMPT, 0, handoff=handoff) is None
    clock.t += 0.2  # past the 2 s deadline
    assert sched.num_matched_tokens("d2", PROMPT, 0, handoff=handoff) == BS  # what is there
    # Pending from the first lookup to the deadline (fake clock: 10 x 0.19 s + 0.2 s).
    assert sched.build_meta(_EMPTY_STEP, {}).handoffs == [("timeout", pytest.approx(2.1))]
    # Resolved: asked again, it never waits a second time.
    assert sched.num_matched_tokens("d2", PROMPT, 0, handoff=handoff) == BS
    # Nothing stored at all: the timeout leaves a plain miss (everything recomputed).
    sched.finished("d2")
    empty = CountingStore(str(tmp_path / "empty"))
    sched2, clock2 = _scheduler(empty, wait_s=0.5)
    assert sched2.num_matched_tokens("d3", PROMPT, 0, handoff=handoff) is None
    clock2.t += 0.6
    assert sched2.num_matched_tokens("d3", PROMPT, 0, handoff=handoff) == 0


def test_no_wait_for_another_prompt_a_down_tier_or_no_l2(tmp_path) -> None:
    handoff = _producer_handoff(tmp_path)
    store = CountingStore(str(tmp_path / "l2"))
    sched, _ = _scheduler(store)
    assert _outcomes(sched) == []
    # Another prompt (or model, or cache_salt): the promised last hash is not this chain's.
    other = [t + 1 for t in PROMPT]
    assert sched.num_matched_tokens("a", other, 0, handoff=handoff) == 0
    assert sched.num_matched_tokens("b", PROMPT, 0, salt="tenant-2", handoff=handoff) == 0
    # Redis down: waiting cannot help; a miss now.
    store.down = True
    assert sched.num_matched_tokens("c", PROMPT, 0, handoff=handoff) == 0
    assert _outcomes(sched) == ["mismatch", "mismatch", "unavailable"]
    # No shared tier, or waiting disabled: plain lookups.
    no_l2, _ = _scheduler(None)
    assert no_l2.num_matched_tokens("d", PROMPT, 0, handoff=handoff) == 0
    off, _ = _scheduler(FilesystemStore(str(tmp_path / "off")), wait_s=0.0)
    assert off.num_matched_tokens("e", PROMPT, 0, handoff=handoff) == 0
    # vLLM's own prefix cache already covers the handoff: nothing to wait for.
    assert sched.num_matched_tokens("g", PROMPT, 4 * BS, handoff=handoff) == 0
    # A handoff longer than the prompt's loadable part waits only for what can be loaded.
    short = PROMPT[: 4 * BS]  # the last chunk is the prompt's end: 3 loadable
    store.down = False
    sched3, _ = _scheduler(store)
    sched3._hashes("f", short)
    _store_chunks(store, sched3, "f", range(3))
    assert sched3.num_matched_tokens("f", short, 0, handoff=handoff) == 3 * BS
