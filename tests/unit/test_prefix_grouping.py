"""Prefix-aware sharding: signatures, the grouped order, the grouped split, the input-order merge.

Files have planted groups (requests sharing a long few-shot prefix, shuffled across the
file); the tests check that shards hold each group back to back with its first request
first, that sizes are balanced and limits kept, that ``auto`` leaves files without shared
prefixes alone, and that merge writes results of reordered shards back in input order with
the exactly-once checks intact.
"""

from __future__ import annotations

import io
import json
import random
from collections import defaultdict
from pathlib import Path

import pytest

from aibrix_operators.batch.job import ValidatedBatch, prefix_order_uri, split_batch, validate_batch
from aibrix_operators.batch.merging import ExactlyOnceViolation, merge_results
from aibrix_operators.batch.prefixes import LEVELS, PrefixSignatures, grouping_order, worth_grouping
from aibrix_operators.batch.sharding import ShardSpec
from aibrix_operators.batch.validation import ValidationLimits
from aibrix_operators.storage import LocalStorage

CHAT = "/v1/chat/completions"


def chat_line(cid: str, content: str, system: str | None = None) -> str:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content})
    return json.dumps({"custom_id": cid, "method": "POST", "url": CHAT,
                       "body": {"model": "m", "messages": messages, "max_tokens": 4}})


def planted(n: int, groups: int, singles: int, seed: int = 0, prefix_words: int = 800) -> tuple[str, dict]:
    """``n`` requests: ``groups`` few-shot templates (~5 KB each) + questions, shuffled, and
    ``singles`` requests with no shared prefix. Returns the file text and custom_id → group."""
    rng = random.Random(seed)
    templates = [" ".join(f"example{g}-{w}" for w in range(prefix_words // 4)) for g in range(groups)]
    group_of: dict[str, int] = {}
    lines = []
    for i in range(n):
        cid = f"r{i}"
        if i < singles:
            content = f"unique {rng.random()} " * 40
            group_of[cid] = -1
        else:
            g = rng.randrange(groups)
            content = templates[g] + f"\nQuestion {i}: what is {rng.random()}?"
            group_of[cid] = g
        lines.append((cid, content))
    rng.shuffle(lines)
    return "".join(chat_line(c, t) + "\n" for c, t in lines), group_of


def validate_and_split(tmp_path: Path, text: str, rps: int = 5000, bps: int = 64 << 20,
                       max_shards: int = 1024, grouping: str = "auto"
                       ) -> tuple[ValidatedBatch, list[ShardSpec]]:
    storage = LocalStorage()
    src = tmp_path / "in.jsonl"
    src.write_text(text)
    out = tmp_path / "out"
    work = str(out / "_work" / "run")
    # A small line limit, so that plan_shards keeps a small byte limit as given (it leaves
    # room for one line of max_line_bytes in every shard).
    report, batch = validate_batch(storage, str(src), str(out), prefix_grouping=grouping,
                                   prefix_order_uri=prefix_order_uri(work),
                                   limits=ValidationLimits(max_line_bytes=16_384))
    assert batch is not None, report.summary()
    return batch, split_batch(storage, batch, work, rps, bps, max_shards)


def shard_ids(shard: ShardSpec) -> list[str]:
    return [json.loads(line)["custom_id"] for line in Path(shard.uri).read_text().splitlines()]


def input_line_of(text: str) -> dict[str, int]:
    return {json.loads(line)["custom_id"]: n for n, line in enumerate(text.splitlines(), start=1)}


def test_shards_hold_whole_groups_back_to_back_first_of_group_first(tmp_path):
    text, group_of = planted(600, groups=12, singles=40)
    batch, shards = validate_and_split(tmp_path, text, rps=100)
    assert batch.prefix_order_uri is not None
    assert batch.prefix_groups == 12 and batch.prefix_shared_requests == 560
    line_of = input_line_of(text)
    sequence = [cid for s in shards for cid in shard_ids(s)]
    assert sorted(sequence, key=line_of.__getitem__) == list(line_of)  # every request once
    # Each group is one contiguous run of the send order, in input order (first of the group first).
    runs: dict[int, list[int]] = defaultdict(list)
    for pos, cid in enumerate(sequence):
        if group_of[cid] >= 0:
            runs[group_of[cid]].append(pos)
    for g, positions in runs.items():
        assert positions == list(range(positions[0], positions[0] + len(positions))), g
        members = [sequence[p] for p in positions]
        assert [line_of[c] for c in members] == sorted(line_of[c] for c in members)
    # A group is cut only at shard boundaries: it spans at most ceil(size / shard) + 1 shards.
    shard_of = {cid: s.index for s in shards for cid in shard_ids(s)}
    for positions in runs.values():
        spanned = {shard_of[sequence[p]] for p in positions}
        assert len(spanned) <= -(-len(positions) // 100) + 1
    # The shard's line-number file says where each of its lines came from.
    for s in shards:
        numbers = Path(s.lines_uri).read_bytes()
        assert len(numbers) == 8 * s.num_requests
        assert s.first_line == line_of[shard_ids(s)[0]]


def test_a_batch_past_the_grouping_ceiling_keeps_file_order_and_every_request(tmp_path, monkeypatch, caplog):
    """Past MAX_GROUPED_REQUESTS the signatures are dropped (validation's memory stays flat) and
    the batch is sent in file order, every request once; at the ceiling it is still grouped."""
    from aibrix_operators.batch import job

    text, _ = planted(120, groups=4, singles=10)
    (tmp_path / "at").mkdir()
    (tmp_path / "past").mkdir()
    monkeypatch.setattr(job, "MAX_GROUPED_REQUESTS", 120)
    batch, _ = validate_and_split(tmp_path / "at", text, rps=50)
    assert batch.prefix_order_uri is not None and batch.prefix_groups == 4
    monkeypatch.setattr(job, "MAX_GROUPED_REQUESTS", 119)
    with caplog.at_level("INFO", logger="aibrix_operators.batch.job"):
        batch, shards = validate_and_split(tmp_path / "past", text, rps=50)
    assert batch.prefix_order_uri is None and batch.prefix_groups == 0
    assert [cid for s in shards for cid in shard_ids(s)] == list(input_line_of(text))
    assert "prefix grouping skipped: the batch has 120 requests, over the 119" in caplog.text


def test_signatures_past_their_ceiling_hold_nothing():
    signatures = PrefixSignatures(max_requests=2)
    line = chat_line("a", "x" * 2000).encode()
    for offset in range(0, 5 * len(line), len(line)):
        signatures.add(line, offset)
    assert signatures.dropped_at == 2 and len(signatures) == 0 and list(signatures.columns()) == []


def test_grouped_shards_are_balanced_and_within_limits(tmp_path):
    text, _ = planted(1000, groups=7, singles=0)
    _, shards = validate_and_split(tmp_path, text, rps=300)
    assert [s.num_requests for s in shards] == [250, 250, 250, 250]
    # A byte limit binds too: no shard over it, sizes are the file's bytes.
    total = len(text.encode())
    _, by_bytes = validate_and_split(tmp_path, text, rps=5000, bps=total // 5)
    assert all(s.num_bytes <= total // 5 for s in by_bytes) and len(by_bytes) in (5, 6)
    assert sum(s.num_bytes for s in by_bytes) == total
    assert all(s.num_bytes == Path(s.uri).stat().st_size for s in by_bytes)
    # max_shards (Airflow's max_map_length) caps the count: shards grow instead.
    _, capped = validate_and_split(tmp_path, text, rps=10, max_shards=3)
    assert len(capped) <= 3 and sum(s.num_requests for s in capped) == 1000


def test_auto_keeps_input_order_without_shared_prefixes(tmp_path):
    text = "".join(chat_line(f"r{i}", f"question {i} " * 60) + "\n" for i in range(50))
    batch, shards = validate_and_split(tmp_path, text, rps=20)
    assert batch.prefix_order_uri is None and batch.prefix_shared_requests == 0
    assert all(s.lines_uri is None for s in shards)
    assert [cid for s in shards for cid in shard_ids(s)] == [f"r{i}" for i in range(50)]


def test_auto_keeps_input_order_with_one_common_system_prompt(tmp_path):
    system = "You are a careful assistant. " * 40  # ~1.2 KB, the same on every line
    text = "".join(chat_line(f"r{i}", f"question {i}", system) + "\n" for i in range(50))
    batch, _ = validate_and_split(tmp_path, text)
    assert batch.prefix_shared_requests == 50 and batch.prefix_order_uri is None


def test_off_computes_nothing_and_keeps_input_order(tmp_path):
    text, _ = planted(200, groups=4, singles=0)
    batch, shards = validate_and_split(tmp_path, text, rps=50, grouping="off")
    assert batch.prefix_order_uri is None and batch.prefix_groups == 0
    assert [cid for s in shards for cid in shard_ids(s)] == list(input_line_of(text))


def test_partial_sharing_nests_subgroups_inside_a_common_header():
    header = "Answer the multiple choice question. " * 30            # ~1.1 KB, shared by all
    topics = [header + f"Topic {t}: " + f"fact{t} " * 500 for t in range(2)]  # ~5 KB templates
    sig = PrefixSignatures()
    order_in = [0, 1, 0, 1, 1, 0]
    for i, t in enumerate(order_in):
        raw = (chat_line(f"r{i}", topics[t] + f" Q{i}") + "\n").encode()
        sig.add(raw, i * 10_000)
    grouping = grouping_order(sig)
    assert grouping.order.tolist() == [0, 2, 5, 1, 3, 4]
    assert worth_grouping(grouping)


def test_prompt_and_short_requests():
    sig = PrefixSignatures()
    long_prompt = "shared context " * 100
    rows = [long_prompt + "a", "short", long_prompt + "b", "tiny"]
    for i, prompt in enumerate(rows):
        raw = json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                          "body": {"model": "m", "prompt": prompt}}).encode() + b"\n"
        sig.add(raw, i)
    grouping = grouping_order(sig)
    assert grouping.order.tolist() == [0, 2, 1, 3]
    assert grouping.shared_requests == 2


def answer(cid: str, error: bool = False) -> str:
    if error:
        return json.dumps({"id": f"b-{cid}", "custom_id": cid, "response": None,
                           "error": {"code": "bad_request", "message": "no"}})
    return json.dumps({"id": f"b-{cid}", "custom_id": cid, "error": None,
                       "response": {"status_code": 200, "request_id": cid,
                                    "body": {"usage": {"prompt_tokens": 3, "completion_tokens": 2}}}})


def test_merge_of_grouped_shards_writes_input_order_with_exactly_once(tmp_path):
    text, _ = planted(300, groups=6, singles=20, seed=3)
    _, shards = validate_and_split(tmp_path, text, rps=70)
    assert all(s.lines_uri for s in shards)
    ids = list(input_line_of(text))
    failing = set(ids[::17])
    segments: dict[int, list[str]] = {}
    for s in shards:
        sid = shard_ids(s)
        # Two overlapping attempts: the second repeats the first shard answers (discarded).
        first = tmp_path / f"seg-{s.index}-a.jsonl"
        first.write_text("".join(answer(c, c in failing) + "\n" for c in reversed(sid)))
        second = tmp_path / f"seg-{s.index}-b.jsonl"
        second.write_text("".join(answer(c, True) + "\n" for c in sid[:3]))
        segments[s.index] = [str(first), str(second)]
    out = tmp_path / "merged"
    summary = merge_results(LocalStorage(), shards, lambda s: segments[s.index], str(out))
    output = [json.loads(line) for line in (out / "output.jsonl").read_text().splitlines()]
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in output] == [c for c in ids if c not in failing]
    assert [r["custom_id"] for r in errors] == [c for c in ids if c in failing]
    assert all(r["error"] is None for r in output)  # first answer won over the repeated error
    assert summary.duplicates_discarded == 3 * len(shards)
    assert (summary.total, summary.failed) == (300, len(failing))
    assert summary.usage.input_tokens == 3 * (300 - len(failing))

    # A missing answer in a reordered shard still fails the merge.
    segments[1] = [segments[1][0]]
    Path(segments[1][0]).write_text("".join(answer(c) + "\n" for c in shard_ids(shards[1])[1:]))
    with pytest.raises(ExactlyOnceViolation, match="have no result"):
        merge_results(LocalStorage(), shards, lambda s: segments[s.index], str(tmp_path / "m2"))


def test_split_refuses_a_file_changed_since_validation(tmp_path):
    text, _ = planted(100, groups=3, singles=0)
    storage = LocalStorage()
    src = tmp_path / "in.jsonl"
    src.write_text(text)
    work = str(tmp_path / "out" / "_work" / "run")
    _, batch = validate_batch(storage, str(src), str(tmp_path / "out"), prefix_grouping="auto",
                              prefix_order_uri=prefix_order_uri(work))
    assert batch is not None and batch.prefix_order_uri
    src.write_text(text.replace('"max_tokens": 4', '"max_tokens": 44', 1))
    with pytest.raises(RuntimeError, match="changed between validation and split"):
        split_batch(storage, batch, work, 50, 1 << 30, 1024)


class _StreamOnlyStorage(LocalStorage):
    """Reads come as a non-seekable stream, as from S3: split must copy before gathering."""

    def open_read(self, uri: str) -> io.BufferedReader:  # type: ignore[override]
        data = Path(uri).read_bytes()

        class Raw(io.RawIOBase):
            def __init__(self) -> None:
                self.src = io.BytesIO(data)

            def readable(self) -> bool:
                return True

            def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
                chunk = self.src.read(len(b))
                b[: len(chunk)] = chunk
                return len(chunk)

        return io.BufferedReader(Raw())


def test_grouped_split_from_a_stream_only_store(tmp_path):
    text, _ = planted(120, groups=3, singles=10)
    src = tmp_path / "in.jsonl"
    src.write_text(text.rstrip("\n"))  # no final newline: split adds it
    storage = _StreamOnlyStorage()
    work = str(tmp_path / "out" / "_work" / "run")
    _, batch = validate_batch(storage, str(src), str(tmp_path / "out"), prefix_grouping="auto",
                              prefix_order_uri=prefix_order_uri(work))
    assert batch is not None and batch.prefix_order_uri
    shards = split_batch(storage, batch, work, 50, 1 << 30, 1024)
    content = sorted(line for s in shards for line in Path(s.uri).read_text().splitlines(keepends=True))
    assert content == sorted(line + "\n" for line in text.rstrip("\n").split("\n"))


def test_signature_columns_line_up_with_their_requests_whatever_each_prompt_reaches():
    """Each request keeps hashes only for the levels its prompt reaches; the columns put every
    hash back on its own request and 0 elsewhere, whatever the mix of lengths."""
    lengths = [10, 300, 5000, 20_000, 10, 1500, 20_000, 300, 4095, 16_383]
    raws = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"model": "m", "prompt": chr(97 + i % 3) * n}}).encode()
            for i, n in enumerate(lengths)]
    sig = PrefixSignatures()
    for i, raw in enumerate(raws):
        sig.add(raw, i * 100_000)

    def reference(raw: bytes) -> list[int]:
        s = raw.find(b'"prompt"')
        n, out, h = len(raw) - s, [], None
        for lo, hi in zip((0, *LEVELS[:-1]), LEVELS, strict=True):
            if n < hi:
                out.append(0)
                continue
            h = (hash(raw[s + lo:s + hi]) if h is None else hash((h, raw[s + lo:s + hi]))) or 1
            out.append(h)
        return out

    expected = [list(col) for col in zip(*(reference(r) for r in raws), strict=True)]
    assert [c.tolist() for c in sig.columns()] == expected
    assert [sum(1 for h in col if h) for col in expected] == [8, 6, 5, 3]
