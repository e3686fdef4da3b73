"""A running batch's partial output (batch/partial.py) from result logs written by the driver's
own writer: ended shards only, each in input order, the first answer per request, no errors."""

from __future__ import annotations

import json
from pathlib import Path

from aibrix_operators.batch.partial import partial_answers
from aibrix_operators.batch.shard_results import ResultLog, fingerprint_shard, results_prefix
from aibrix_operators.batch.sharding import ShardSpec
from aibrix_operators.storage import LocalStorage


def answer(cid: str, attempt: str, error: bool = False) -> bytes:
    if error:
        return json.dumps({"id": f"r-{cid}", "custom_id": cid, "response": None,
                           "error": {"code": "server_error", "message": "boom"}}).encode()
    body = {"usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    return json.dumps({"id": f"r-{cid}", "custom_id": cid, "error": None,
                       "response": {"status_code": 200, "request_id": attempt, "body": body}}).encode()


def shard(storage: LocalStorage, root: Path, index: int, ids: list[str]) -> ShardSpec:
    uri = str(root / f"shard-{index}.jsonl")
    storage.write_bytes(uri, b"".join(json.dumps({"custom_id": c, "body": {}}).encode() + b"\n" for c in ids))
    return ShardSpec(index=index, uri=uri, first_line=1 + 10 * index, num_requests=len(ids), num_bytes=0)


def log_for(storage: LocalStorage, work: str, spec: ShardSpec, attempt: str) -> ResultLog:
    binding = fingerprint_shard(storage, spec.uri).binding
    return ResultLog(storage, results_prefix(work, spec.name), binding, attempt_id=attempt)


def test_ended_shards_answers_in_input_order_once_without_errors(tmp_path: Path) -> None:
    storage, work = LocalStorage(), str(tmp_path / "work")
    shards = [shard(storage, tmp_path, 0, ["a", "b", "c"]), shard(storage, tmp_path, 1, ["d", "e"]),
              shard(storage, tmp_path, 2, ["f"])]
    first = log_for(storage, work, shards[0], "0001")
    for line in (answer("c", "first"), answer("a", "first"), answer("b", "first", error=True)):
        first.append(line)
    first.flush()
    again = log_for(storage, work, shards[0], "0002")  # an overlapping attempt answered "a" again
    again.append(answer("a", "second"))
    again.flush()
    other = log_for(storage, work, shards[1], "0001")
    for cid in ("e", "d"):
        other.append(answer(cid, "first"))
    other.flush()

    out = b"".join(partial_answers(storage, shards, done=(1, 0), work=work))  # shard 2 still runs
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["custom_id"] for r in records] == ["a", "c", "d", "e"]  # shard order, input order, no error
    assert records[0]["response"]["request_id"] == "first"  # the first answer wins, as in merge
    assert out.endswith(b"\n")
    assert b"".join(partial_answers(storage, shards, done=(), work=work)) == b""
