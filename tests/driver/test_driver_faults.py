"""The driver against a real local HTTP server that injects faults.

Invariant under every fault: each custom_id of the shard appears exactly once
in the shard's result log, as a success or as an error record.
"""

from __future__ import annotations

import json
import time
from typing import Any

from aibrix_operators.batch.job import (
    finalize_batch,
    split_batch,
    validate_batch,
    work_prefix,
)
from aibrix_operators.batch.jsonfast import dumps
from aibrix_operators.batch.records import success_record
from aibrix_operators.batch.shard_results import shard_result_log
from aibrix_operators.driver.batch_shard import run_shard_of_batch
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.runner import run_shard
from aibrix_operators.storage import LocalStorage

MAX_ATTEMPTS = 3
# Every test's request timeout: on a loaded machine (the suite's other workers, vLLM beside them)
# an answer from this in-process server once took longer than 0.5 s, twice (a slow:0.1 answer,
# then a plain 400 sent twice, 2026-12-05): a test that counts attempts must not race a timeout.
REQUEST_TIMEOUT_S = 2.0
HANG_S = 3 * REQUEST_TIMEOUT_S  # a hang the timeout must cut
RECORD_KEYS = {"id", "custom_id", "response", "error"}


def config(server, **overrides) -> DriverConfig:
    values = dict(
        endpoint=server.url + "/v1", concurrency=4, max_attempts=MAX_ATTEMPTS,
        request_timeout_s=REQUEST_TIMEOUT_S, connect_timeout_s=2.0, backoff_base_s=0.01,
        backoff_max_s=0.5, flush_interval_s=0.05, progress_interval_s=0.2, api_key_env=None,
    )
    values.update(overrides)
    return DriverConfig(**values)


def write_shard(tmp_path, records) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "shard-00000.jsonl"
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records))
    return str(path)


def one_shard_batch(
    storage: LocalStorage, tmp_path, records: list[dict], run_id: str = "run"
) -> tuple[Any, str, Any]:
    """``records`` validated as a batch (output under ``tmp_path/out``) and split into one shard:
    the batch, its run's work prefix and the shard."""
    inp = tmp_path / "input.jsonl"
    inp.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records))
    out = str(tmp_path / "out")
    report, batch = validate_batch(storage, str(inp), out)
    assert report.ok, report.summary()
    work = work_prefix(out, run_id)
    (shard,) = split_batch(storage, batch, work, len(records), bytes_per_shard=1 << 30, max_shards=1)
    return batch, work, shard


def results_by_id(storage, prefix, shard_uri) -> dict[str, dict]:
    """Every stored record by custom_id; fails if any id is stored twice."""
    seen: dict[str, dict] = {}
    for cid, line in shard_result_log(storage, prefix, shard_uri).iter_records():
        assert cid not in seen, f"{cid} answered twice"
        record = json.loads(line)
        assert set(record) == RECORD_KEYS
        seen[cid] = record
    return seen


async def run(tmp_path, server, records, **overrides):
    storage = LocalStorage()
    prefix = str(tmp_path / "results")
    shard = write_shard(tmp_path, records)
    outcome = await run_shard(storage, shard, prefix, config(server, **overrides))
    return outcome, results_by_id(storage, prefix, shard)


def interleave(failing: list[dict], ok: list[dict], every: int = 4) -> list[dict]:
    """``failing`` spread through ``ok``, so the endpoint answers others while they fail."""
    out: list[dict] = []
    ok_iter = iter(ok)
    for f in failing:
        out.append(f)
        out.extend(r for _, r in zip(range(every - 1), ok_iter, strict=False))
    return out + list(ok_iter)


async def test_every_fault_kind_answers_each_id_exactly_once(tmp_path, fault_server, make_request):
    recoverable = {
        "ok": ["ok"],
        "slow": ["slow:0.1"],
        "429-then-ok": ["429", "ok"],
        "429ra-then-ok": ["429ra:0", "ok"],
        "500-then-ok": ["500", "ok"],
        "503-twice-then-ok": ["503", "503", "ok"],
        "timeout-then-ok": [f"hang:{HANG_S}", "ok"],
        "drop-then-ok": ["drop", "ok"],
        "partial-then-ok": ["partial", "ok"],
        "nonjson-then-ok": ["nonjson", "ok"],
        "badusage": ["badusage"],
    }
    # Failures that belong to the request: a 4xx at once; a 5xx, garbled answer, timeout or
    # dropped connection that keeps coming back while the server answers everyone else (the
    # @ delays keep other requests being answered during each failing attempt).
    permanent = {
        "400": (["400"], "invalid_value", 400, 1),
        "nonjson": (["nonjson@0.05"], "invalid_response_body", 200, MAX_ATTEMPTS),
        "503-always": (["503@0.05"], "server_error", 503, MAX_ATTEMPTS),
        "timeout-always": ([f"hang:{HANG_S}"], "timeout", None, MAX_ATTEMPTS),
        "drop-always": (["drop@0.05"], "connection_error", None, MAX_ATTEMPTS),
        "400-after-500": (["500@0.05", "400"], "invalid_value", 400, 2),
    }
    ok = [make_request(f"{name}-{i}", *plan) for i in range(3) for name, plan in recoverable.items()]
    ok += [make_request(f"filler-{i}", "slow:0.005") for i in range(300)]
    # Sparse enough that failing requests never hold every worker at once.
    failing = [make_request(f"{name}-{i}", *spec[0]) for i in range(2) for name, spec in permanent.items()]
    records = interleave(failing, ok, every=28)
    outcome, results = await run(tmp_path, fault_server, records, concurrency=8)

    assert set(results) == {r["custom_id"] for r in records}
    assert len(results) == len(records)
    assert (outcome.total, outcome.completed, outcome.failed, outcome.resumed) == (
        len(records), len(ok), len(failing), 0)

    for name, plan in recoverable.items():
        for i in range(3):
            cid = f"{name}-{i}"
            rec = results[cid]
            assert rec["error"] is None, (cid, rec)
            assert rec["response"]["status_code"] == 200
            assert rec["response"]["body"]["choices"][0]["message"]["content"] == f"answer {cid}"
            assert fault_server.count(cid) == len(plan), cid
    for name, (_plan, code, status, attempts) in permanent.items():
        for i in range(2):
            cid = f"{name}-{i}"
            rec = results[cid]
            assert set(rec["error"]) == {"code", "message"}
            assert rec["error"]["code"] == code, (cid, rec)
            assert rec["error"]["message"]
            if status is None:
                assert rec["response"] is None
            else:
                assert rec["response"]["status_code"] == status
                assert rec["response"]["request_id"] == f"rq-{cid}-{attempts}"
            assert fault_server.count(cid) == attempts, cid
    # 400: the server's own error body is kept for the user
    assert results["400-0"]["response"]["body"]["error"]["message"] == "messages must not be empty"
    assert "proxy says hi" in results["nonjson-0"]["response"]["body"]
    assert "after 3 attempts" in results["timeout-always-0"]["error"]["message"]
    # the retries counted by the driver are exactly the extra attempts the server saw
    assert outcome.retries == sum(fault_server.counts().values()) - len(records)
    # a usage block that is not numbers counts as zero instead of crashing the shard
    assert outcome.usage["input_tokens"] == 5 * (outcome.completed - 3)
    assert outcome.usage["output_tokens"] == 3 * (outcome.completed - 3)
    # Timeouts cut the attempt: each retry of a hanging request arrived while the previous
    # attempt's hang still ran (the server's arrival order, not a wall-clock budget).
    for cid in ("timeout-always-0", "timeout-always-1", "timeout-then-ok-0"):
        arrivals = fault_server.times(cid)
        assert all(b - a < HANG_S for a, b in zip(arrivals, arrivals[1:], strict=False)), (cid, arrivals)


async def test_non_retryable_4xx_is_sent_once(tmp_path, fault_server, make_request):
    records = [make_request(f"bad-{i}", "400", "ok") for i in range(5)]
    outcome, results = await run(tmp_path, fault_server, records, max_attempts=5)
    assert outcome.failed == 5 and outcome.retries == 0
    assert fault_server.counts() == {f"bad-{i}": 1 for i in range(5)}
    assert all(r["response"]["status_code"] == 400 for r in results.values())


async def test_a_404_for_a_model_the_server_lost_is_retried_not_the_requests_error(
    tmp_path, fault_server, make_request
):
    """vLLM answers 404 "The model `m` does not exist." without ``param`` when a LoRA adapter is
    unloaded between its model check and its adapter lookup: the server's loss, retried (a
    suite run turned 4 such requests into error lines). A 404 for a path is the request's own."""
    records = [make_request(f"lost-{i}", "404model", "ok") for i in range(3)]
    records += [make_request("route", "404route", "ok")]
    records += [make_request(f"ok-{i}", "slow:0.01") for i in range(20)]
    outcome, results = await run(tmp_path, fault_server, records, max_attempts=5)
    assert all(results[f"lost-{i}"]["error"] is None for i in range(3))
    assert {fault_server.count(f"lost-{i}") for i in range(3)} == {2}
    assert results["route"]["response"]["status_code"] == 404 and fault_server.count("route") == 1
    assert outcome.failed == 1 and outcome.retries == 3


async def test_retry_after_is_honoured(tmp_path, fault_server, make_request):
    records = [make_request("ra", "429ra:0.4", "ok"), make_request("no-ra", "429", "ok")]
    outcome, results = await run(tmp_path, fault_server, records)
    assert all(r["error"] is None for r in results.values())
    ra = fault_server.times("ra")
    assert len(ra) == 2 and ra[1] - ra[0] >= 0.38
    no_ra = fault_server.times("no-ra")
    # without Retry-After our own backoff applies: base 0.01 s, first retry at most 0.01 s
    assert len(no_ra) == 2 and no_ra[1] - no_ra[0] < 0.3
    assert outcome.retries == 2


async def test_retries_are_bounded_by_max_attempts(tmp_path, fault_server, make_request):
    failing = [make_request(f"r{i}", "503@0.05") for i in range(4)]
    ok = [make_request(f"ok{i}", "slow:0.01") for i in range(100)]
    outcome, results = await run(tmp_path, fault_server, interleave(failing, ok), max_attempts=4)
    assert {f"r{i}": fault_server.count(f"r{i}") for i in range(4)} == {f"r{i}": 4 for i in range(4)}
    assert outcome.retries == 12 and outcome.failed == 4
    assert {results[f"r{i}"]["error"]["code"] for i in range(4)} == {"server_error"}
    assert all("after 4 attempts" in results[f"r{i}"]["error"]["message"] for i in range(4))
    outcome, _ = await run(tmp_path / "single", fault_server,
                           interleave([make_request("s", "503@0.05")], ok[:20]), max_attempts=1)
    assert fault_server.count("s") == 1 and outcome.retries == 0 and outcome.failed == 1


async def test_slow_responses_with_bounded_concurrency(tmp_path, fault_server, make_request):
    records = [make_request(f"s{i}", "slow:0.15") for i in range(12)]
    started = time.monotonic()
    outcome, results = await run(tmp_path, fault_server, records, concurrency=3)
    elapsed = time.monotonic() - started
    assert outcome.completed == 12 and len(results) == 12
    assert fault_server.max_inflight == 3  # bounded, and used: no more, no less
    assert elapsed >= 12 / 3 * 0.15  # four rounds of three, each at least as slow as the server


async def test_resume_skips_answered_ids(tmp_path, fault_server, make_request):
    storage = LocalStorage()
    prefix = str(tmp_path / "results")
    records = [make_request(f"c{i}") for i in range(10)]
    shard = write_shard(tmp_path, records)
    earlier = shard_result_log(storage, prefix, shard)
    for i in (0, 3, 7):
        earlier.append(dumps(success_record(f"c{i}", 200, "old", {"old": True})))
    earlier.flush()
    outcome = await run_shard(storage, shard, prefix, config(fault_server))
    assert (outcome.resumed, outcome.completed, outcome.total) == (3, 7, 10)
    assert set(fault_server.counts()) == {f"c{i}" for i in range(10)} - {"c0", "c3", "c7"}
    results = results_by_id(storage, prefix, shard)
    assert len(results) == 10 and results["c3"]["response"]["body"] == {"old": True}
    # a second resume has nothing left to do and sends nothing
    before = sum(fault_server.counts().values())
    again = await run_shard(storage, str(tmp_path / "shard-00000.jsonl"), prefix, config(fault_server))
    assert (again.resumed, again.completed, again.failed) == (10, 0, 0)
    assert sum(fault_server.counts().values()) == before


async def test_expired_deadline_sends_nothing(tmp_path, fault_server, make_request):
    records = [make_request(f"e{i}") for i in range(4)]
    outcome, results = await run(tmp_path, fault_server, records, deadline=time.time() - 1)
    assert fault_server.counts() == {}
    assert outcome.failed == 4
    assert {r["error"]["code"] for r in results.values()} == {"batch_expired"}


async def test_batch_steps_end_to_end_under_faults(tmp_path, fault_server, make_request):
    storage = LocalStorage()
    plans = [["ok"], ["500", "ok"], ["400"], ["drop", "ok"], ["429", "ok"], ["nonjson", "ok"], ["slow:0.05"]]
    records = [make_request(f"id-{i:03d}", *plans[i % len(plans)]) for i in range(40)]
    for r in records:
        r["body"]["model"] = "m"
    inp = tmp_path / "input.jsonl"
    inp.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records) + b"\n")
    out = str(tmp_path / "out")
    report, batch = validate_batch(storage, str(inp), out)
    assert report.ok, report.summary()
    work = work_prefix(out, "run")
    shards = split_batch(storage, batch, work, requests_per_shard=9, bytes_per_shard=1 << 20, max_shards=8)
    assert len(shards) == 5
    for shard in shards:
        await run_shard_of_batch(storage, shard, work, config(fault_server))
    summary, obj = finalize_batch(storage, batch, shards, work)
    out_lines = [json.loads(x) for x in (tmp_path / "out" / "output.jsonl").read_bytes().splitlines()]
    err_lines = [json.loads(x) for x in (tmp_path / "out" / "errors.jsonl").read_bytes().splitlines()]
    ok_ids = [r["custom_id"] for r in records if r["body"]["fault"] != ["400"]]
    bad_ids = [r["custom_id"] for r in records if r["custom_id"] not in ok_ids]
    assert [r["custom_id"] for r in out_lines] == ok_ids  # input order
    assert [r["custom_id"] for r in err_lines] == bad_ids
    assert obj.request_counts == {"total": 40, "completed": len(ok_ids), "failed": len(bad_ids)}
    assert summary.error_codes == {"invalid_value": 6}
    assert obj.status == "completed" and summary.duplicates_discarded == 0
    assert obj.usage["total_tokens"] == 8 * len(ok_ids)
