"""Prefix affinity in the P/D router (router/affinity.py), against real aiohttp stub instances."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from aibrix_operators.router.affinity import BLOCK_BYTES, MAX_BLOCKS, PrefixIndex, prefix_blocks
from aibrix_operators.router.app import CHECKER, PROXY
from aibrix_operators.router.backends import DECODE, PREFILL, Backend
from tests.router.harness import RouterHarness
from tests.router.stub_backend import StubBackend

# ~2.5 KB of shared text: four whole 512-byte blocks before the first byte that differs.
TEMPLATES = [f"Template {t}: " + " ".join(f"example {t}.{i} -> answer {i * t};" for i in range(100))
             for t in range(4)]  # fmt: skip


def chat(template: int, question: int, salt: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "system", "content": TEMPLATES[template]},
                     {"role": "user", "content": f"question {question}?"}],
        "max_tokens": 4,
    }  # fmt: skip
    if salt is not None:
        body["cache_salt"] = salt
    return body


def completion(template: int, question: int) -> dict[str, Any]:
    return {"model": "m", "prompt": TEMPLATES[template] + f" Q{question}?", "max_tokens": 4}


class Routed:
    def __init__(self, server: TestServer, session: aiohttp.ClientSession) -> None:
        self.server, self.session = server, session
        self.url = str(server.make_url("")).rstrip("/")

    async def post(self, body: dict[str, Any]) -> str:
        """The name of the decode stub that answered."""
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        async with self.session.post(self.url + path, json=body) as r:
            assert r.status == 200
            return json.loads(await r.read())["from"]

    async def refresh(self) -> None:
        await self.server.app[CHECKER].refresh()

    async def metric(self, role: str, outcome: str) -> float:
        async with self.session.get(self.url + "/metrics") as r:
            text = await r.text()
        line = f'router_prefix_affinity_total{{outcome="{outcome}",role="{role}"}} '
        for row in text.splitlines():
            if row.startswith(line):
                return float(row[len(line) :])
        return 0.0


@pytest.fixture
async def make_router() -> AsyncIterator[Callable[..., Any]]:
    harness = RouterHarness()

    async def make(prefill: list[StubBackend], decode: list[StubBackend], **kwargs: Any) -> Routed:
        for stub in (*prefill, *decode):
            await stub.start()
        backends = [Backend(s.url, PREFILL) for s in prefill] + [Backend(s.url, DECODE) for s in decode]
        return Routed(*await harness.serve(backends, [*prefill, *decode], **kwargs))

    yield make
    await harness.close()


def _groups_by_stub(stubs: list[StubBackend]) -> dict[tuple[str, int], set[str]]:
    """(chat or prompt, template number) -> names of the stubs that received such a request."""
    seen: dict[tuple[str, int], set[str]] = {}
    for stub in stubs:
        for path, body in stub.received:
            text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
            seen.setdefault((path, int(text.split(":", 1)[0].split()[1])), set()).add(stub.name)
    return seen


async def test_same_prefix_requests_go_to_one_instance_of_each_role(make_router) -> None:
    prefill = [StubBackend(f"p{i}") for i in range(2)]
    decode = [StubBackend(f"d{i}") for i in range(3)]
    router = await make_router(prefill, decode)
    # Interleaved, as a shuffled file would send them: template q % 4, chat and completion prompts.
    for q in range(24):
        await router.post(chat(q % 4, q) if (q // 4) % 2 else completion(q % 4, q))
    by_decode, by_prefill = _groups_by_stub(decode), _groups_by_stub(prefill)
    assert all(len(names) == 1 for names in by_decode.values()), by_decode
    assert all(len(names) == 1 for names in by_prefill.values()), by_prefill
    # First sight of a prefix is least-loaded (round-robin at equal load): groups spread.
    assert len(set().union(*by_decode.values())) >= 2
    # 8 prompts (4 templates x chat/completion) seen for the first time, 16 repeats.
    assert await router.metric(DECODE, "miss") == 8 and await router.metric(DECODE, "hit") == 16
    assert await router.metric(PREFILL, "hit") == 16


async def test_without_affinity_the_same_requests_spread(make_router) -> None:
    # The control for the test above: the stubs' equal load alone would spread every group.
    decode = [StubBackend(f"d{i}") for i in range(3)]
    router = await make_router([StubBackend("p")], decode, prefix_affinity=False)
    for q in range(24):
        await router.post(chat(q % 4, q))
    assert all(len(names) > 1 for names in _groups_by_stub(decode).values())
    assert await router.metric(DECODE, "hit") == 0


async def test_a_holder_busier_than_the_slack_is_passed_over(make_router) -> None:
    a, b = StubBackend("a"), StubBackend("b")
    router = await make_router([StubBackend("p")], [a, b], affinity_slack=4)
    first = await router.post(chat(0, 0))
    holder, other = (a, b) if first == "a" else (b, a)
    holder.running = 4  # within the slack (score 4 vs 0): still the holder
    await router.refresh()
    assert await router.post(chat(0, 1)) == holder.name
    holder.running = 5  # beyond it: least-loaded
    await router.refresh()
    assert await router.post(chat(0, 2)) == other.name
    assert await router.metric(DECODE, "overloaded") == 1
    # The other instance took the prefix too; both hold it now, and the less loaded is chosen.
    holder.running, other.running = 0, 2
    await router.refresh()
    assert await router.post(chat(0, 3)) == holder.name
    holder.running, other.running = 3, 0
    await router.refresh()
    assert await router.post(chat(0, 4)) == other.name
    assert await router.metric(DECODE, "hit") == 3


async def test_an_unhealthy_holder_is_replaced_by_the_least_loaded(make_router) -> None:
    a, b = StubBackend("a"), StubBackend("b")
    router = await make_router([StubBackend("p")], [a, b])
    first = await router.post(chat(1, 0))
    holder, other = (a, b) if first == "a" else (b, a)
    holder.healthy = False
    await router.refresh()
    assert await router.post(chat(1, 1)) == other.name
    holder.healthy = True
    other.running = 1
    await router.refresh()
    # Both took the prefix; the deeper match is equal, so the less loaded of the two.
    assert await router.post(chat(1, 2)) == holder.name


async def test_the_index_is_bounded_and_forgets_least_recently_used_prefixes(make_router) -> None:
    decode = [StubBackend(f"d{i}") for i in range(2)]
    router = await make_router([StubBackend("p")], decode, affinity_entries=12)
    for q in range(40):  # 40 distinct prompts of 5 blocks each, then the first again
        await router.post({"model": "m", "prompt": f"{q:04d}" + "x" * 2600, "max_tokens": 1})
    affinity = router.server.app[PROXY].affinity
    assert affinity is not None and len(affinity.index(DECODE)) == 12
    assert await router.metric(DECODE, "hit") == 0
    await router.post({"model": "m", "prompt": "0000" + "x" * 2600, "max_tokens": 1})
    assert await router.metric(DECODE, "miss") == 41  # forgotten


def test_prefix_index_lru_keeps_what_was_touched() -> None:
    idx = PrefixIndex(capacity=4)
    idx.record([1, 2], "http://a")
    idx.record([3, 4], "http://b")
    assert idx.match([1, 2, 9]) == {"http://a": 2}
    idx.record([1], "http://c")  # touches block 1 (newest holder first), leaves 2 the oldest
    idx.record([5], "http://b")
    assert len(idx) == 4
    assert idx.match([1, 2]) == {"http://c": 1, "http://a": 1}  # block 2 was evicted
    assert idx.match([3, 4]) == {"http://b": 2}


def test_prefix_blocks_follow_the_shared_prompt_and_its_salt() -> None:
    def blocks(body: dict[str, Any]) -> list[int]:
        return prefix_blocks(json.dumps(body).encode(), body)

    a = blocks(chat(0, 1))
    assert len(a) >= 4 and blocks(chat(0, 2)) == a  # the questions fall in the last, partial block
    long_a, long_b = (blocks({**chat(0, 0), "messages": [*chat(0, 0)["messages"],
                                                        {"role": "user", "content": c * 2000}]})
                      for c in "ab")  # fmt: skip
    assert long_a[: len(a)] == long_b[: len(a)] == a and long_a[len(a) + 1 :] != long_b[len(a) + 1 :]
    assert blocks(chat(1, 1))[0] != a[0]
    # Another tenant's salt never matches (its KV is not shareable), nor another model.
    assert not set(blocks(chat(0, 1, salt="tenant-b"))) & set(a)
    assert not set(blocks({**chat(0, 1), "model": "other"})) & set(a)
    assert blocks({"model": "m", "prompt": "short"}) == []
    huge = {"model": "m", "prompt": "y" * (BLOCK_BYTES * (MAX_BLOCKS + 50))}
    assert len(blocks(huge)) == MAX_BLOCKS
