"""Prefix warm-up in the driver (driver/warmup.py): a real aiohttp endpoint records when each
request arrives and is answered; the driver runs real shards from local files."""

from __future__ import annotations

import asyncio
import json
import time
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from aibrix_operators.batch.prefixes import PrefixSignatures, prefix_hashes
from aibrix_operators.batch.shard_results import shard_result_log
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.runner import run_shard
from aibrix_operators.driver.warmup import WarmupGate
from aibrix_operators.storage import LocalStorage

# ~1.3 KB templates: requests of one template share more than LEVELS[MIN_LEVEL] = 1024 bytes.
TEMPLATES = {g: f"Template {g}. " + " ".join(f"Example {g}.{i}: {i} + {i} = {2 * i}." for i in range(60))
             for g in "ABC"}  # fmt: skip


def request(group: str, k: int, delay: float) -> dict[str, Any]:
    return {
        "custom_id": f"{group}{k}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "max_tokens": 4,
                 "messages": [{"role": "system", "content": TEMPLATES[group]},
                              {"role": "user", "content": f"{group}{k} delay={delay}"}]},
    }  # fmt: skip


@dataclass
class Recorder:
    """An OpenAI-shaped endpoint that answers after the delay named in the question."""

    arrived: dict[str, float] = field(default_factory=dict)
    answered: dict[str, float] = field(default_factory=dict)
    server: TestServer | None = None

    async def post(self, request: web.Request) -> web.Response:
        body = await request.json()
        tag, delay = body["messages"][-1]["content"].split(" delay=")
        self.arrived[tag] = time.monotonic()
        await asyncio.sleep(float(delay))
        self.answered[tag] = time.monotonic()
        return web.json_response({"id": f"r-{tag}", "object": "chat.completion", "choices": [],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1}})  # fmt: skip

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")


@pytest.fixture
async def recorder() -> AsyncIterator[Recorder]:
    rec = Recorder()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", rec.post)
    rec.server = TestServer(app, host="127.0.0.1")
    await rec.server.start_server()
    yield rec
    await rec.server.close()


def write_shard(tmp_path: Path, records: list[dict[str, Any]], grouped: bool) -> str:
    path = tmp_path / "shard-00000.jsonl"
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records))
    if grouped:  # what the grouped split writes next to each shard: input line numbers
        (tmp_path / "shard-00000.lines").write_bytes(array("q", range(1, len(records) + 1)).tobytes())
    return str(path)


async def run(tmp_path: Path, recorder: Recorder, records: list[dict[str, Any]], grouped: bool,
              **kwargs: Any) -> dict[str, dict[str, Any]]:  # fmt: skip
    storage = LocalStorage()
    shard = write_shard(tmp_path, records, grouped)
    config = DriverConfig(endpoint=recorder.url, concurrency=8, api_key_env=None, flush_interval_s=0.05,
                          progress_interval_s=60)  # fmt: skip
    outcome = await run_shard(storage, shard, str(tmp_path / "results"), config, warm_up=True, **kwargs)
    seen: dict[str, dict[str, Any]] = {}
    for cid, line in shard_result_log(storage, str(tmp_path / "results"), shard).iter_records():
        assert cid not in seen, f"{cid} answered twice"
        seen[cid] = json.loads(line)
    assert outcome.completed + outcome.resumed == len(records) == len(seen)
    return seen


def grouped_records() -> list[dict[str, Any]]:
    # Split order: group A, group B, then a singleton; each group's first request first.
    return ([request("A", k, 0.3) for k in range(6)] + [request("B", k, 0.3) for k in range(6)]
            + [request("C", 0, 0.05)])  # fmt: skip


async def test_followers_wait_for_their_leader_and_other_groups_do_not(tmp_path, recorder) -> None:
    await run(tmp_path, recorder, grouped_records(), grouped=True)
    arrived, answered = recorder.arrived, recorder.answered
    for g in "AB":
        for k in range(1, 6):
            assert arrived[f"{g}{k}"] >= answered[f"{g}0"], f"{g}{k} was sent before {g}0 was answered"
    # While A's followers wait, B's leader and the singleton are already out.
    assert arrived["B0"] < answered["A0"] and arrived["C0"] < answered["A0"]


async def test_without_grouping_the_group_goes_out_at_once(tmp_path, recorder) -> None:
    # The same lines in a shard without a .lines file (not split in prefix order): unchanged
    # behaviour, so followers arrive while the leader is still computing.
    await run(tmp_path, recorder, grouped_records(), grouped=False)
    assert any(recorder.arrived[f"A{k}"] < recorder.answered["A0"] for k in range(1, 6))


async def test_warm_up_is_off_unless_asked_for(tmp_path, recorder) -> None:
    storage = LocalStorage()
    shard = write_shard(tmp_path, grouped_records(), grouped=True)
    config = DriverConfig(endpoint=recorder.url, concurrency=8, api_key_env=None, progress_interval_s=60)
    outcome = await run_shard(storage, shard, str(tmp_path / "results"), config)
    assert outcome.completed == 13
    assert any(recorder.arrived[f"A{k}"] < recorder.answered["A0"] for k in range(1, 6))


async def test_the_wait_is_bounded(tmp_path, recorder) -> None:
    records = [request("A", 0, 2.0)] + [request("A", k, 0.01) for k in range(1, 4)]
    await run(tmp_path, recorder, records, grouped=True, warmup_wait_s=0.3)
    for k in range(1, 4):
        waited = recorder.arrived[f"A{k}"] - recorder.arrived["A0"]
        assert 0.25 <= waited and recorder.arrived[f"A{k}"] < recorder.answered["A0"]


async def test_a_resumed_shard_sends_only_what_is_missing(tmp_path, recorder) -> None:
    records = grouped_records()
    first = await run(tmp_path, recorder, records, grouped=True)
    recorder.arrived.clear()
    again = await run(tmp_path, recorder, records, grouped=True)
    assert again == first and recorder.arrived == {}


def test_prefix_hashes_are_validations_signatures() -> None:
    sigs = PrefixSignatures()
    lines = [json.dumps(request(g, k, 0)).encode() for g in "AB" for k in range(2)]
    lines += [b'{"custom_id":"x","body":{"prompt":"' + b"p" * 5000 + b'"}}', b'{"body":{"prompt":"short"}}']
    for line in lines:
        sigs.add(line, 0)
    # The columns stop at the first level no prompt reaches: every prompt is 0 from there on.
    columns = list(sigs.columns())
    assert len(columns) == 3  # the 5,000-byte prompt reaches 4096, none reaches 16384
    for i, line in enumerate(lines):
        assert prefix_hashes(line) == tuple(int(c[i]) for c in columns) + (0,) * (4 - len(columns))


async def test_nested_groups_wait_for_their_own_leader() -> None:
    # Level hashes (256 B, 1 KB, 4 KB, 16 KB): a header shared at 1 KB by all, two templates
    # at 4 KB. b waits for a (same template), c (a new template) for a (the header's first),
    # d for c; e shares only 256 bytes with d: too little to wait for.
    items = [({"custom_id": cid}, hashes) for cid, hashes in [
        ("a", (1, 2, 3, 0)), ("b", (1, 2, 3, 0)), ("c", (1, 2, 4, 0)), ("d", (1, 2, 4, 0)),
        ("e", (1, 9, 9, 0)),
    ]]  # fmt: skip
    gate = WarmupGate(iter(items), wait_s=60)

    async def take() -> tuple[str, Any]:
        item = await asyncio.wait_for(gate.next(), 0.2)
        assert item is not None
        return item[0]["custom_id"], item[1]

    a, lead_a = await take()
    e, _ = await take()
    assert (a, e) == ("a", "e") and gate.parked == 3
    with pytest.raises(TimeoutError):
        await take()  # b, c, d are held
    gate.answered(lead_a)
    (b, _), (c, lead_c) = await take(), await take()
    assert (b, c) == ("b", "c") and gate.parked == 1
    gate.answered(lead_c)
    assert (await take())[0] == "d"
    assert await asyncio.wait_for(gate.next(), 0.2) is None
