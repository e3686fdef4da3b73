"""Splitting a validated file into shards: limits, growth under max_shards, order, blanks."""

from __future__ import annotations

import io
import json
import random

import pytest

from aibrix_operators.batch.sharding import ShardSpec, plan_shards, split_file
from aibrix_operators.batch.validation import ValidationLimits, validate_stream


def split(storage, write_file, tmp_path, data, rps, bps, max_shards=1024, max_line=4 * 1024 * 1024):
    uri = write_file(data)
    report = validate_stream(io.BytesIO(data), limits=ValidationLimits(max_line_bytes=max_line))
    assert report.ok, report.summary()
    plan = plan_shards(report.total_requests, report.total_bytes, rps, bps, max_shards, max_line)
    return plan, split_file(storage, uri, str(tmp_path / "work"), report, plan)


def shard_lines(storage, shards):
    return [storage.read_bytes(s.uri).splitlines(keepends=True) for s in shards]


def test_split_by_request_count(storage, write_file, tmp_path, lines):
    data = lines(10)
    _, shards = split(storage, write_file, tmp_path, data, rps=4, bps=1 << 30)
    assert [s.num_requests for s in shards] == [4, 4, 2]
    assert [s.first_line for s in shards] == [1, 5, 9]
    assert [s.index for s in shards] == [0, 1, 2]
    assert [s.name for s in shards] == ["shard-00000", "shard-00001", "shard-00002"]
    assert b"".join(b"".join(x) for x in shard_lines(storage, shards)) == data
    for s, content in zip(shards, shard_lines(storage, shards), strict=True):
        assert s.num_bytes == sum(map(len, content))
        assert s.uri.startswith(str(tmp_path / "work" / "shards"))


def test_split_by_bytes(storage, write_file, tmp_path, lines):
    data = lines(20, pad=50)
    one = len(data) // 20
    _, shards = split(storage, write_file, tmp_path, data, rps=1000, bps=3 * one + 5, max_line=one)
    assert [s.num_requests for s in shards] == [3] * 6 + [2]
    assert all(s.num_bytes <= 3 * one + 5 for s in shards)


def test_input_order_is_kept(storage, write_file, tmp_path, line):
    ids = [f"id-{random.Random(1).random()}-{i}" for i in range(37)]
    data = b"".join(line(cid, pad=i % 7 * 30) for i, cid in enumerate(ids))
    _, shards = split(storage, write_file, tmp_path, data, rps=5, bps=700)
    got = [json.loads(x)["custom_id"] for content in shard_lines(storage, shards) for x in content]
    assert got == ids
    assert sum(s.num_requests for s in shards) == 37


def test_trailing_blanks_not_copied_and_final_newline_added(storage, write_file, tmp_path, lines):
    data = lines(3).rstrip(b"\n")
    _, shards = split(storage, write_file, tmp_path, data, rps=2, bps=1 << 30)
    assert storage.read_bytes(shards[-1].uri).endswith(b"}\n")
    data = lines(3) + b"\n\n   \n"
    _, shards = split(storage, write_file, tmp_path, data, rps=2, bps=1 << 30)
    contents = shard_lines(storage, shards)
    assert [len(c) for c in contents] == [2, 1]
    assert all(x.strip() for c in contents for x in c)
    assert b"".join(b"".join(c) for c in contents) == lines(3)


def test_plan_grows_shards_to_stay_under_max_shards():
    plan = plan_shards(10_000, 1_000_000, requests_per_shard=10, bytes_per_shard=1 << 30, max_shards=100)
    assert plan.requests_per_shard == 100
    plan = plan_shards(10, 10_000_000, requests_per_shard=1000, bytes_per_shard=1000,
                       max_shards=100, max_line_bytes=500)
    assert plan.bytes_per_shard >= 10_000_000 // 100 + 500
    # small inputs keep the requested sizes
    assert plan_shards(10, 100, 4, 64) == type(plan)(4, 64)
    with pytest.raises(ValueError):
        plan_shards(10, 100, 0, 64)


def test_max_shards_respected_when_split(storage, write_file, tmp_path, lines):
    data = lines(50)
    plan, shards = split(storage, write_file, tmp_path, data, rps=1, bps=1 << 30, max_shards=7)
    assert len(shards) <= 7
    assert sum(s.num_requests for s in shards) == 50


def test_max_shards_respected_when_request_and_byte_limits_both_bind(storage, write_file, tmp_path, line):
    # Many tiny lines, then a few huge ones: request-closed and byte-closed shards add up.
    data = b"".join(line(f"t{i}") for i in range(8)) + b"".join(line(f"h{i}", pad=1000) for i in range(4))
    _, shards = split(storage, write_file, tmp_path, data, rps=1, bps=1, max_shards=4, max_line=1200)
    assert len(shards) <= 4
    assert sum(s.num_requests for s in shards) == 12


@pytest.mark.parametrize("seed", range(6))
def test_max_shards_respected_for_random_line_sizes(storage, write_file, tmp_path, line, seed):
    rng = random.Random(seed)
    pads = [rng.choice([0, 0, 0, 10, 400, 1500]) for _ in range(rng.randint(20, 120))]
    data = b"".join(line(f"r{i}", pad=p) for i, p in enumerate(pads))
    max_shards = rng.randint(1, 12)
    _, shards = split(storage, write_file, tmp_path, data, rps=rng.randint(1, 5),
                      bps=rng.randint(1, 3000), max_shards=max_shards, max_line=2000)
    assert 1 <= len(shards) <= max_shards
    assert b"".join(storage.read_bytes(s.uri) for s in shards) == data


def test_refuses_invalid_report(storage, write_file, tmp_path, line):
    data = line("a", method="GET")
    report = validate_stream(io.BytesIO(data))
    with pytest.raises(ValueError, match="failed validation"):
        split_file(storage, write_file(data), str(tmp_path / "w"), report, plan_shards(1, len(data)))


def test_file_changed_since_validation_is_detected(storage, write_file, tmp_path, lines):
    report = validate_stream(io.BytesIO(lines(5)))
    uri = write_file(lines(4))
    with pytest.raises(RuntimeError, match="changed between validation and split"):
        split_file(storage, uri, str(tmp_path / "w"), report, plan_shards(5, 1000))


def test_shard_spec_round_trips_through_a_dict():
    spec = ShardSpec(3, "/x/shard-00003.jsonl", 11, 5, 900)
    assert ShardSpec.from_dict(json.loads(json.dumps(spec.as_dict()))) == spec
