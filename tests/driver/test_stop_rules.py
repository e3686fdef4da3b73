"""Stop rules (batch/stop_rules.py, driver/stop_watch.py) with the real driver, a real HTTP server
and the batch's steps (validate, split, the shards' drivers, merge) on local storage.

A batch whose requests fail with their own errors stops under ``max_error_rate``; an outage of the
endpoint in the same batch does not trip it; a budget stops a batch at ``max_total_tokens``; the
shards are judged together. Every id ends exactly once either way, the answers so far in the output.
"""

from __future__ import annotations

import asyncio
import json
import threading

from aibrix_operators.batch.job import finalize_batch, split_batch, validate_batch, work_prefix
from aibrix_operators.batch.stop_rules import StopRules, StopTally, stop_marker_uri, stop_prefix, tally_uri
from aibrix_operators.driver.batch_shard import run_shard_of_batch
from aibrix_operators.driver.cancel import CancelWatch
from aibrix_operators.driver.stop_watch import StopWatch
from aibrix_operators.storage import LocalStorage
from tests.driver.test_driver_faults import config

TOKENS_PER_ANSWER = 8  # the fake's usage: 5 prompt + 3 completion tokens


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_bytes().splitlines()] if path.exists() else []


async def run_batch(tmp_path, server, records, rules: dict, shards: int = 2, together: bool = True,
                    **overrides):
    """validate → split → every shard's driver (at once, or one after the other) → merge."""
    storage = LocalStorage()
    inp = tmp_path / "input.jsonl"
    inp.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records))
    out = tmp_path / "out"
    report, batch = validate_batch(storage, str(inp), str(out), stop_rules=rules)
    assert report.ok, report.summary()
    work = work_prefix(str(out), "run")
    planned = split_batch(storage, batch, work, requests_per_shard=-(-len(records) // shards),
                          bytes_per_shard=1 << 30, max_shards=shards)
    assert len(planned) == shards
    rules = StopRules.from_dict(batch.stop_rules)
    cfg = config(server, stop_rules=rules, **{"stop_poll_s": 0.1, **overrides})
    runs = [run_shard_of_batch(storage, shard, work, cfg) for shard in planned]
    if together:
        outcomes = await asyncio.gather(*runs)
    else:
        outcomes = [await one for one in runs]
    summary, obj = finalize_batch(storage, batch, planned, work)
    return obj, outcomes, lines(out / "output.jsonl"), lines(out / "errors.jsonl"), work


def ids_once(records, out_lines, err_lines) -> None:
    ids = [r["custom_id"] for r in out_lines + err_lines]
    assert sorted(ids) == sorted(r["custom_id"] for r in records), "every id exactly once"


async def test_a_batch_whose_requests_fail_on_their_own_stops_under_max_error_rate(
        tmp_path, fault_server, make_request):
    # Four of five requests are refused (a 400: the request's own error), each answered after 20 ms:
    # 400 answers a second at most, so the rule (judged every 0.1 s) trips long before the end.
    records = [make_request(f"r{i:04d}", "ok@0.02" if i % 5 == 0 else "400@0.02") for i in range(1000)]
    obj, outcomes, out_lines, err_lines, _ = await run_batch(
        tmp_path, fault_server, records, {"max_error_rate": 0.5, "error_rate_min_sample": 40})

    assert obj.status == "failed"
    [error] = obj.errors["data"]
    assert error["code"] == "max_error_rate_exceeded" and error["param"] == "stop_rules"
    assert "over its max_error_rate of 50.0%" in error["message"], error["message"]
    ids_once(records, out_lines, err_lines)
    stopped = [e for e in err_lines if e["error"]["code"] == "batch_stopped"]
    refused = [e for e in err_lines if e["error"]["code"] != "batch_stopped"]
    # It stopped early: most of the batch was never sent, and what was answered is in the output.
    assert len(stopped) > 500, len(stopped)
    assert sum(fault_server.counts().values()) == len(out_lines) + len(refused) < 500
    assert all("max_error_rate stop rule" in e["error"]["message"] for e in stopped)
    assert [o["custom_id"] for o in out_lines] == sorted(o["custom_id"] for o in out_lines)  # input order
    assert {o.stopped_by for o in outcomes} == {"max_error_rate"}
    assert obj.aibrix_unanswered == len(stopped)
    assert obj.request_counts == {"total": 1000, "completed": len(out_lines), "failed": len(err_lines)}


async def test_an_outage_in_the_same_batch_does_not_trip_max_error_rate(tmp_path, fault_server, make_request):
    # One request in a hundred is refused (1 %, under the 5 % rule: at most 2 of any first 100 answers
    # of the two shards, whenever the rule looks); the endpoint goes away (its port refuses
    # connections) for 1.5 s while the batch runs, and comes back.
    records = [make_request(f"r{i:04d}", "400@0.01" if i % 100 == 7 else "ok@0.01") for i in range(300)]
    threading.Timer(0.3, fault_server.down).start()
    threading.Timer(1.8, fault_server.up).start()
    obj, outcomes, out_lines, err_lines, work = await run_batch(
        tmp_path, fault_server, records, {"max_error_rate": 0.05, "error_rate_min_sample": 100},
        probe_interval_s=0.2, breaker_failures=3)

    assert sum(o.outages for o in outcomes) >= 1, "the endpoint's outage was seen"
    assert obj.status == "completed" and obj.errors is None
    assert not LocalStorage().exists(stop_marker_uri(work))
    ids_once(records, out_lines, err_lines)
    assert len(err_lines) == 3 and {e["error"]["code"] for e in err_lines} != {"batch_stopped"}


async def test_a_budget_stops_the_batch_at_max_total_tokens(tmp_path, fault_server, make_request):
    records = [make_request(f"r{i:04d}", "ok@0.02") for i in range(600)]
    budget = 50 * TOKENS_PER_ANSWER
    # One shard after the other: the first spends the budget, the second sends nothing. No round
    # with the store comes while the first runs (a minute apart): its own live counts trip it.
    obj, outcomes, out_lines, err_lines, _ = await run_batch(
        tmp_path, fault_server, records, {"max_total_tokens": budget}, together=False, stop_poll_s=60.0)

    assert obj.status == "failed"
    [error] = obj.errors["data"]
    assert error["code"] == "max_total_tokens_exceeded"
    assert f"reaching its max_total_tokens budget of {budget}" in error["message"], error["message"]
    ids_once(records, out_lines, err_lines)
    tokens = obj.usage["total_tokens"]
    # Judged every 0.5 s (LOCAL_S), 4 requests in flight at 20 ms each (200 answers a second): past
    # the budget by about 100 answers; 250 (most of the shard) would mean the rule looked 1.25 s late.
    assert budget <= tokens < budget + 250 * TOKENS_PER_ANSWER, tokens
    assert tokens == len(out_lines) * TOKENS_PER_ANSWER
    assert outcomes[1].completed == 0 and outcomes[1].stopped_by == "max_total_tokens"
    second_shard = {r["custom_id"] for r in records[300:]}
    assert not second_shard & set(fault_server.counts()), "the second shard sent nothing"


def test_the_batch_is_judged_as_a_whole(tmp_path) -> None:
    """Neither shard alone reaches the sample or the budget; together they trip the rule, and the
    shard that found it writes the marker the others stop at."""
    storage = LocalStorage()
    prefix = stop_prefix(str(tmp_path / "work"))
    storage.write_bytes(tally_uri(prefix, "shard-00001"),
                        json.dumps(StopTally(30, 20, 150, 90).as_dict() | {"final": True}).encode())
    rules = StopRules(max_error_rate=0.5, error_rate_min_sample=50)
    own = StopTally(25, 15, 125, 75)
    cancel = CancelWatch(storage, None, 1.0)
    watch = StopWatch(storage, prefix, "shard-00000", rules, cancel, 0.1, lambda: own)
    reason = watch.check()
    assert reason is not None and reason.rule == "max_error_rate"
    assert reason.figures == {"answered": 55, "own_errors": 35, "input_tokens": 275, "output_tokens": 165}
    # Another shard of the run sees the marker on its next round, whatever its own counts.
    other = StopWatch(storage, prefix, "shard-00002", StopRules(max_total_tokens=10**9),
                      CancelWatch(storage, None, 1.0), 0.1, StopTally)
    assert other.check() == reason
    # Under the rule (a shard alone: 25 answers < 50) nothing trips.
    alone = StopWatch(storage, stop_prefix(str(tmp_path / "w2")), "shard-00000", rules, cancel, 0.1,
                      lambda: own)
    assert alone.check() is None
