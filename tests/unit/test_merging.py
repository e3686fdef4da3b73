"""Merge: input order across shards, output format, and the exactly-once check."""

from __future__ import annotations

import io
import json
import random

import pytest

from aibrix_operators.batch.jsonfast import dumps
from aibrix_operators.batch.merging import ExactlyOnceViolation, merge_results
from aibrix_operators.batch.records import error_record, success_record
from aibrix_operators.batch.sharding import plan_shards, split_file
from aibrix_operators.batch.validation import validate_stream

RECORD_KEYS = {"id", "custom_id", "response", "error"}


def make_shards(storage, write_file, tmp_path, data, rps):
    report = validate_stream(io.BytesIO(data))
    plan = plan_shards(report.total_requests, report.total_bytes, rps, 1 << 30)
    return split_file(storage, write_file(data), str(tmp_path / "work"), report, plan)


def body(cid: str) -> dict:
    return {"id": f"chatcmpl-{cid}", "object": "chat.completion", "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                      "prompt_tokens_details": {"cached_tokens": 1}}}


def result_for(cid: str) -> bytes:
    n = int(cid.rsplit("-", 1)[1])
    if n % 4 == 3:
        return dumps(error_record(cid, "http_400", "bad request", 400, f"r-{cid}",
                                  {"error": {"message": "bad"}}))
    return dumps(success_record(cid, 200, f"r-{cid}", body(cid)))


def write_segments(storage, tmp_path, shards, order_of, extra=None):
    """Each shard's results, in shuffled order, spread over two segment files."""
    segs: dict[int, list[str]] = {}
    for s in shards:
        ids = [json.loads(x)["custom_id"] for x in storage.read_bytes(s.uri).splitlines()]
        ids = order_of(ids)
        recs = [result_for(c) for c in ids] + (extra or {}).get(s.index, [])
        half = len(recs) // 2
        segs[s.index] = []
        for k, chunk in enumerate((recs[:half], recs[half:])):
            uri = str(tmp_path / "results" / s.name / f"seg-{k}.jsonl")
            storage.write_bytes(uri, b"".join(r + b"\n" for r in chunk))
            segs[s.index].append(uri)
    return lambda shard: segs[shard.index]


def read_jsonl(storage, uri):
    return [json.loads(x) for x in storage.read_bytes(uri).splitlines()]


def test_merge_keeps_input_order_and_format(storage, write_file, tmp_path, lines):
    shards = make_shards(storage, write_file, tmp_path, lines(22), rps=5)
    segments_of = write_segments(storage, tmp_path, shards, lambda ids: list(reversed(ids)))
    # shards handed over out of order: merge still follows the input
    summary = merge_results(storage, list(reversed(shards)), segments_of, str(tmp_path / "out"))
    out = read_jsonl(storage, summary.output_uri)
    errs = read_jsonl(storage, summary.errors_uri)
    all_ids = [f"req-{i}" for i in range(22)]
    assert [r["custom_id"] for r in out] == [c for c in all_ids if int(c[4:]) % 4 != 3]
    assert [r["custom_id"] for r in errs] == [c for c in all_ids if int(c[4:]) % 4 == 3]
    for r in out:
        assert set(r) == RECORD_KEYS
        assert r["id"].startswith("batch_req_")
        assert r["error"] is None
        assert set(r["response"]) == {"status_code", "request_id", "body"}
        assert r["response"]["status_code"] == 200
        assert r["response"]["request_id"] == f"r-{r['custom_id']}"
    for r in errs:
        assert set(r) == RECORD_KEYS
        assert r["error"] == {"code": "http_400", "message": "bad request"}
        assert r["response"]["status_code"] == 400
    assert (summary.total, summary.completed, summary.failed) == (22, 17, 5)
    assert summary.error_codes == {"http_400": 5}
    usage = summary.usage.as_dict()
    assert usage["input_tokens"] == 17 * 3 and usage["output_tokens"] == 17 * 2
    assert usage["total_tokens"] == 17 * 5
    assert usage["input_tokens_details"] == {"cached_tokens": 17}
    d = summary.as_dict()
    assert d["request_counts"] == {"total": 22, "completed": 17, "failed": 5}


def test_missing_result_raises(storage, write_file, tmp_path, lines):
    shards = make_shards(storage, write_file, tmp_path, lines(10), rps=4)
    segments_of = write_segments(storage, tmp_path, shards,
                                 lambda ids: [c for c in ids if c != "req-5"])
    with pytest.raises(ExactlyOnceViolation, match=r"shard-00001: 1 request\(s\) have no result.*req-5"):
        merge_results(storage, shards, segments_of, str(tmp_path / "out"))


def test_repeated_answers_keep_the_first_and_are_counted(storage, write_file, tmp_path, lines):
    shards = make_shards(storage, write_file, tmp_path, lines(10), rps=4)
    # An overlapping attempt answered req-8 (first segment: success) again, later, as an error.
    later = dumps(error_record("req-8", "timeout", "from the zombie attempt"))
    segments_of = write_segments(storage, tmp_path, shards, lambda ids: ids, extra={2: [later, later]})
    summary = merge_results(storage, shards, segments_of, str(tmp_path / "out"))
    assert summary.duplicates_discarded == 2
    assert summary.as_dict()["duplicates_discarded"] == 2
    out = read_jsonl(storage, summary.output_uri)
    errs = read_jsonl(storage, summary.errors_uri)
    assert [r["custom_id"] for r in out].count("req-8") == 1
    assert "req-8" not in [r["custom_id"] for r in errs]
    assert (summary.total, summary.completed + summary.failed) == (10, 10)


def test_unknown_result_raises(storage, write_file, tmp_path, lines):
    shards = make_shards(storage, write_file, tmp_path, lines(10), rps=4)
    stray = dumps(success_record("not-in-batch", 200, "r", body("x-0")))
    segments_of = write_segments(storage, tmp_path, shards, lambda ids: ids, extra={0: [stray]})
    with pytest.raises(ExactlyOnceViolation, match="not in the shard.*not-in-batch"):
        merge_results(storage, shards, segments_of, str(tmp_path / "out"))


def test_result_of_another_shard_raises(storage, write_file, tmp_path, lines):
    shards = make_shards(storage, write_file, tmp_path, lines(8), rps=4)
    # req-1 answered in shard 1's log instead of shard 0's: missing there, unknown here
    segments_of = write_segments(
        storage, tmp_path, shards,
        lambda ids: [c for c in ids if c != "req-1"] + (["req-1"] if "req-4" in ids else []))
    with pytest.raises(ExactlyOnceViolation, match="shard-00000.*no result.*req-1"):
        merge_results(storage, shards, segments_of, str(tmp_path / "out"))


def test_failed_merge_publishes_nothing(storage, write_file, tmp_path, lines):
    shards = make_shards(storage, write_file, tmp_path, lines(6), rps=3)
    segments_of = write_segments(storage, tmp_path, shards, lambda ids: ids[:-1])
    with pytest.raises(ExactlyOnceViolation):
        merge_results(storage, shards, segments_of, str(tmp_path / "out"))
    assert not (tmp_path / "out" / "output.jsonl").exists()
    assert not (tmp_path / "out" / "errors.jsonl").exists()


def test_answers_larger_than_the_read_window_come_back_byte_for_byte(storage, write_file, tmp_path, lines):
    """A shard's answers (~4 MB here, several of merge's 1 MiB read-back windows) in random
    order, with repeats: every output line is its request's first answer, byte for byte."""
    n = 6000
    shards = make_shards(storage, write_file, tmp_path, lines(n), rps=n)
    first = {f"req-{i}": dumps(success_record(f"req-{i}", 200, f"r-{i}", {
        "choices": [{"message": {"content": f"answer {i} " + "x" * (i % 700)}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})) for i in range(n)}
    order = list(first)
    random.Random(7).shuffle(order)
    repeat = [dumps(error_record(c, "timeout", "from a later attempt")) for c in order[:50]]
    seg = tmp_path / "results" / "seg-0.jsonl"
    storage.write_bytes(str(seg), b"".join(line + b"\n" for line in [first[c] for c in order] + repeat))
    summary = merge_results(storage, shards, lambda s: [str(seg)], str(tmp_path / "out"))
    assert storage.read_bytes(summary.output_uri) == b"".join(first[f"req-{i}"] + b"\n" for i in range(n))
    assert storage.read_bytes(summary.errors_uri) == b""
    assert (summary.completed, summary.duplicates_discarded) == (n, 50)
