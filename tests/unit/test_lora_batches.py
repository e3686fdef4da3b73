"""LoRA adapters as batch models, without a server: the registry, validation, split by adapter,
merge back in input order.

The end-to-end run against vLLM with adapters pulled from SeaweedFS is
tests/integration/test_lora_dag.py.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest

from aibrix_operators.batch.job import prefix_order_uri, split_batch, validate_batch
from aibrix_operators.batch.merging import merge_results
from aibrix_operators.batch.validation import validate_stream
from aibrix_operators.lora.registry import AdapterRegistryError, load_registry, parse_registry
from aibrix_operators.storage import LocalStorage

PIN = "ab" * 32
BASES = {"sql": "base", "chat": "base", "legal": "base", "other-lora": "other-base"}


def line(cid: str, model: str, text: str = "hello") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": model, "max_tokens": 2,
                                "messages": [{"role": "user", "content": text}]}}) + "\n"


def entry(name: str, base: str = "base", **over: object) -> dict:
    return {"name": name, "base_model": base, "uri": f"s3://adapters/{name}/", "manifest_sha256": PIN,
            **over}


# ---------------------------------------------------------------------------- the registry


def test_registry_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "adapters.yaml"
    path.write_text("adapters:\n"
                    f"  - {{name: sql, base_model: base, uri: 's3://adapters/sql', "
                    f"manifest_sha256: {PIN}}}\n"
                    f"  - {{name: chat, base_model: base, uri: 's3://adapters/chat/v2/', "
                    f"manifest_sha256: {PIN}}}\n")
    registry = load_registry(path)
    assert registry.bases() == {"sql": "base", "chat": "base"}
    assert registry.get("sql").uri == "s3://adapters/sql/"
    assert registry.get("sql").version == PIN[:16]
    with pytest.raises(AdapterRegistryError, match="'nope' is not in .*adapters.yaml"):
        registry.get("nope")


@pytest.mark.parametrize(("raw", "message"), [
    (entry("../x"), r"name '\.\./x' must be"),
    (entry("a", uri="/models/a"), "uri '/models/a' must be s3://bucket/prefix/"),
    (entry("a", uri="s3://bucket"), "must be s3://bucket/prefix/"),
    (entry("a", manifest_sha256="AB" * 32), "manifest_sha256 must be 64 lowercase hex"),
    (entry("a", base="a"), "its own name as base_model"),
    (entry("a", extra=1), r"unknown key\(s\) \['extra'\]"),
    ({"name": "a"}, "base_model must be"),
])
def test_registry_entry_refused_by_key(raw: dict, message: str) -> None:
    with pytest.raises(AdapterRegistryError, match=message):
        parse_registry({"adapters": [raw]}, "reg.yaml")


def test_registry_refuses_duplicates_and_adapter_named_like_a_base() -> None:
    with pytest.raises(AdapterRegistryError, match="'a' is listed twice"):
        parse_registry({"adapters": [entry("a"), entry("a")]}, "reg.yaml")
    with pytest.raises(AdapterRegistryError, match=r"\['a'\] are both an adapter and a base model"):
        parse_registry({"adapters": [entry("a"), entry("b", base="a")]}, "reg.yaml")


# ---------------------------------------------------------------------------- validation


def validate(text: str, adapters: dict[str, str] | None = BASES):
    return validate_stream(io.BytesIO(text.encode()), adapters=adapters)


def test_mixed_base_and_adapters_validate() -> None:
    text = line("a", "sql") + line("b", "base") + line("c", "chat") + line("d", "sql")
    report = validate(text)
    assert report.ok, report.summary()
    # The first line names an adapter: the batch's model is its base.
    assert report.model == "base"
    assert report.adapter_counts == {"sql": 2, "chat": 1}
    assert "adapter(s) sql (2), chat (1)" in report.summary()


def test_unknown_adapter_refused_with_its_line() -> None:
    report = validate(line("a", "base") + line("b", "sql") + line("c", "sqll"))
    assert not report.ok
    (err,) = report.errors
    assert (err.line, err.code, err.param) == (3, "unknown_model", "body.model")
    assert "'sqll' is neither the batch's model 'base' nor one of its LoRA adapters" in err.message
    assert "chat, legal, sql" in err.message


def test_adapter_of_another_base_refused() -> None:
    report = validate(line("a", "sql") + line("b", "other-lora"))
    (err,) = report.errors
    assert (err.line, err.code) == (2, "mismatched_model")
    assert "adapter of 'other-base', but this batch's base model is 'base'" in err.message


def test_without_a_registry_one_model_per_batch_as_before() -> None:
    report = validate(line("a", "base") + line("b", "sql"), adapters=None)
    (err,) = report.errors
    assert (err.line, err.code) == (2, "mismatched_model")
    assert report.adapter_counts == {}


# ---------------------------------------------------------------------------- split and merge


def mixed_file(n: int, seed: int = 3) -> tuple[str, dict[str, str]]:
    rng = random.Random(seed)
    models = ["base", "sql", "chat", "legal"]
    rows = [(f"r{i:03d}", rng.choice(models)) for i in range(n)]
    return "".join(line(cid, m, f"question {cid}") for cid, m in rows), dict(rows)


@pytest.mark.parametrize("grouping", ["auto", "off"])
def test_split_puts_each_adapter_in_shards_of_its_own(tmp_path: Path, grouping: str) -> None:
    text, model_of = mixed_file(120)
    src = tmp_path / "in.jsonl"
    src.write_text(text)
    storage = LocalStorage()
    work = str(tmp_path / "work")
    report, batch = validate_batch(storage, str(src), str(tmp_path / "out"), prefix_grouping=grouping,
                                   prefix_order_uri=prefix_order_uri(work), adapters=BASES)
    assert batch is not None, report.summary()
    assert batch.model == "base" and sorted(batch.adapters) == ["chat", "legal", "sql"]
    shards = split_batch(storage, batch, work, requests_per_shard=25, bytes_per_shard=1 << 20,
                         max_shards=64)
    seen: list[str] = []
    for shard in shards:
        lines = [json.loads(raw) for raw in Path(shard.uri).read_text().splitlines()]
        models = {r["body"]["model"] for r in lines}
        # One model per shard, and the shard says which adapter it needs.
        assert models == {shard.adapter or "base"}, (shard.name, models)
        assert len(lines) <= 25
        seen += [r["custom_id"] for r in lines]
    assert sorted(seen) == sorted(model_of)  # every request once
    # Each adapter's requests are back to back in send order: one run per model.
    runs = [shards[0].adapter]
    for shard in shards[1:]:
        if shard.adapter != runs[-1]:
            runs.append(shard.adapter)
    assert len(runs) == 4, runs

    # Merge writes the answers back in input order.
    for shard in shards:
        results = Path(work) / "results" / shard.name
        results.mkdir(parents=True)
        (results / "part-0.jsonl").write_text("".join(
            json.dumps({"id": "x", "custom_id": json.loads(raw)["custom_id"], "error": None,
                        "response": {"status_code": 200, "request_id": "r", "body": {"usage": {}}}}) + "\n"
            for raw in Path(shard.uri).read_text().splitlines()))
    summary = merge_results(storage, shards,
                            lambda s: [str(Path(work) / "results" / s.name / "part-0.jsonl")],
                            str(tmp_path / "out"))
    out = [json.loads(r)["custom_id"] for r in (tmp_path / "out" / "output.jsonl").read_text().splitlines()]
    assert out == list(model_of)
    assert summary.completed == 120


def test_a_batch_of_the_base_alone_is_not_reordered(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(line(f"r{i}", "base", f"q{i}") for i in range(10)))
    storage = LocalStorage()
    work = str(tmp_path / "work")
    _, batch = validate_batch(storage, str(src), str(tmp_path / "out"), prefix_grouping="auto",
                              prefix_order_uri=prefix_order_uri(work), adapters=BASES)
    assert batch is not None and batch.adapters == [] and batch.prefix_order_uri is None
    (shard,) = split_batch(storage, batch, work, 100, 1 << 20, 8)
    assert shard.adapter is None and shard.lines_uri is None
