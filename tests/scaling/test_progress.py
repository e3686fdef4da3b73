"""Progress from real result logs on local disk: incremental reads, usage sums, exact done,
and the remaining work the policy gets."""

from __future__ import annotations

import json
from pathlib import Path

from aibrix_operators.batch.shard_results import ResultLog, fingerprint_shard, results_prefix
from aibrix_operators.batch.sharding import ShardSpec
from aibrix_operators.scaling.progress import ProgressTracker, profile_requests, sample_profile
from aibrix_operators.storage import LocalStorage


def _request(i: int, max_tokens: int | None = 100) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                       "body": body}).encode()


def _answer(i: int) -> bytes:
    return json.dumps({"id": f"b{i}", "custom_id": f"r{i}", "error": None, "response": {
        "status_code": 200, "body": {"usage": {"prompt_tokens": 120, "completion_tokens": 30}}}}).encode()


def test_profile_of_chat_lines_and_defaults() -> None:
    p = profile_requests([_request(0), _request(1, None), b""], default_max_tokens=300)
    assert p.prompt_tokens == 100 and p.max_tokens == 200
    emb = json.dumps({"body": {"model": "e", "input": "y" * 80}}).encode()
    assert profile_requests([emb]).max_tokens == 0 and profile_requests([emb]).prompt_tokens == 20


def test_tracker_reads_new_segments_only_and_confirms_done(tmp_path: Path) -> None:
    storage = LocalStorage()
    work = str(tmp_path / "work")
    shard_file = tmp_path / "shard-00000.jsonl"
    shard_file.write_bytes(b"\n".join(_request(i) for i in range(4)) + b"\n")
    assert sample_profile(storage, str(shard_file)).max_tokens == 100
    shard = ShardSpec(0, str(shard_file), 1, 4, shard_file.stat().st_size)
    log = ResultLog(storage, results_prefix(work, shard.name), fingerprint_shard(storage, shard.uri).binding)
    for i in range(3):
        log.append(_answer(i))
    log.flush()

    tracker = ProgressTracker(storage, work, [shard])
    p = tracker.poll()
    assert (p.total, p.answered, p.prompt_tokens, p.completion_tokens, p.done) == (4, 3, 360, 90, False)
    rem = p.remaining(sample_profile(storage, shard.uri))
    # 1 request left; prompt from usage (120), output = max 100 x observed ratio 30/100.
    assert (rem.requests, rem.prompt_tokens, rem.output_tokens) == (1, 120, 30)

    # Resumed from its state (as the sensor does between ticks): the old segment is not re-read.
    resumed = ProgressTracker(storage, work, [shard], json.loads(json.dumps(tracker.state())))
    log.append(_answer(1))  # a repeat from an overlapping attempt: 4 lines, only 3 unique ids
    log.flush()
    p = resumed.poll()
    assert (p.answered, p.done) == (4, False)  # the exact scan says not done yet
    log.append(_answer(3))
    log.flush()
    p = resumed.poll()
    assert p.done and p.remaining(sample_profile(storage, shard.uri)).requests == 0


def test_tracker_cursor_stays_one_number_per_attempt(tmp_path: Path) -> None:
    """The cursor rides in the deferral's kwargs at every tick: however many segments an
    attempt writes, it keeps one number per attempt, and reads each segment once."""
    storage = LocalStorage()
    work = str(tmp_path / "work")
    shard_file = tmp_path / "shard-00000.jsonl"
    shard_file.write_bytes(b"\n".join(_request(i) for i in range(60)) + b"\n")
    shard = ShardSpec(0, str(shard_file), 1, 60, shard_file.stat().st_size)
    binding = fingerprint_shard(storage, shard.uri).binding
    tracker = ProgressTracker(storage, work, [shard])
    for attempt in range(2):  # a first attempt and its retry, 30 one-answer segments each
        log = ResultLog(storage, results_prefix(work, shard.name), binding)
        for i in range(attempt * 30, attempt * 30 + 30):
            log.append(_answer(i))
            log.flush()
            if i % 7 == 0:
                tracker = ProgressTracker(storage, work, [shard], json.loads(json.dumps(tracker.state())))
                tracker.poll()
    p = tracker.poll()
    assert (p.answered, p.prompt_tokens, p.done) == (60, 60 * 120, True)
    [cursor] = tracker.state()["shards"].values()
    assert len(cursor["seen"]) == 2 and sorted(cursor["seen"].values()) == [30, 30]
    assert len(json.dumps(tracker.state())) < 400
