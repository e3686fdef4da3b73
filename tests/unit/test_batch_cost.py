"""Usage and cost (issue 40): the deployment's prices times a batch's usage, in batch.json, the Batch
API's object (live while it runs), the CLI's status and the nightly eval's report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai.types import Batch

from aibrix_operators.batch.cost import Prices, PricesError, cost_line, parse_prices
from aibrix_operators.batch.job import finalize_batch, split_batch, validate_batch, work_prefix
from aibrix_operators.batch.lifecycle import RunSnapshot, TaskState
from aibrix_operators.batch.records import error_record, success_record
from aibrix_operators.batch.shard_results import ResultLog, fingerprint_shard, results_prefix
from aibrix_operators.batch_api.status import batch_object
from aibrix_operators.client.cli import describe_batch
from aibrix_operators.evaluation.report import render_html, render_markdown
from aibrix_operators.evaluation.stats import Interval
from aibrix_operators.storage import LocalStorage

PRICES = Prices(input=0.50, output=1.50, cached=0.25, currency="EUR")
USAGE = {"input_tokens": 3_000_000, "input_tokens_details": {"cached_tokens": 1_000_000},
         "output_tokens": 2_000_000, "output_tokens_details": {"reasoning_tokens": 0},
         "total_tokens": 5_000_000}


def test_the_deployments_prices_are_parsed_or_refused_by_name() -> None:
    assert parse_prices("input=0.50, cached=0.25, output=1.50, currency=eur") == PRICES
    assert parse_prices(" ") is None and parse_prices(None) is None
    assert parse_prices("input=1,output=2").cached_or_input == 1.0  # no cached price: the input's
    for text, says in (("input=1", "at least input= and output="), ("input=1,output=x", "output='x'"),
                       ("input=1,output=-2", "output='-2'"), ("input=1,output=2,gpu=3", "unknown key 'gpu'"),
                       ("input=1,output=2,currency=euro", "3-letter code"), ("input", "not key=value")):
        with pytest.raises(PricesError, match="prices") as exc:
            parse_prices(text)
        assert says in str(exc.value), (text, str(exc.value))


def test_a_cost_line_prices_cached_input_apart() -> None:
    line = cost_line(USAGE, PRICES)
    # 2M uncached input at 0.50, 1M cached at 0.25, 2M output at 1.50 per million tokens.
    assert line == {"currency": "EUR", "input": 1.0, "cached_input": 0.25, "output": 3.0, "total": 4.25,
                    "cached_share": 0.3333,
                    "per_million": {"input": 0.5, "cached_input": 0.25, "output": 1.5}}
    assert cost_line(USAGE, None) is None and cost_line(None, PRICES) is None
    # A server that reports more cached than input tokens cannot make input cost negative.
    odd = cost_line({"input_tokens": 10, "input_tokens_details": {"cached_tokens": 99}, "output_tokens": 0},
                    PRICES)
    assert odd["input"] == 0.0 and odd["cached_share"] == 1.0


def test_merge_writes_the_cost_of_the_answers_into_batch_json(tmp_path: Path) -> None:
    storage = LocalStorage()
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                       "body": {"model": "m", "messages": []}}) + "\n" for i in range(4)))
    _, batch = validate_batch(storage, str(inp), str(tmp_path / "out"))
    work = work_prefix(str(tmp_path / "out"), "run")
    [shard] = split_batch(storage, batch, work, requests_per_shard=10, bytes_per_shard=1 << 20, max_shards=1)
    log = ResultLog(storage, results_prefix(work, shard.name), fingerprint_shard(storage, shard.uri).binding)
    for i in range(3):
        body = {"usage": {"prompt_tokens": 1000, "completion_tokens": 500,
                          "prompt_tokens_details": {"cached_tokens": 400}}}
        log.append(json.dumps(success_record(f"r{i}", 200, "q", body)).encode())
    log.append(json.dumps(error_record("r3", "invalid_value", "no")).encode())
    log.flush()
    _, obj = finalize_batch(storage, batch, [shard], work, prices=PRICES)
    published = json.loads((tmp_path / "out" / "batch.json").read_text())
    assert published["aibrix_cost"] == obj.aibrix_cost == cost_line(published["usage"], PRICES)
    assert published["usage"]["input_tokens"] == 3000 and published["aibrix_cost"]["cached_share"] == 0.4
    _, plain = finalize_batch(storage, batch, [shard], work)
    assert "aibrix_cost" not in json.loads((tmp_path / "out" / "batch.json").read_text())  # no prices
    assert plain.aibrix_cost is None


def _snap(run_state: str, **tasks: list[str]) -> RunSnapshot:
    conf = {"completion_window": "1h", "batch_endpoint": "/v1/chat/completions",
            "openai_batch": {"input_file_id": "file-x", "created_at": 100}}
    return RunSnapshot("batch_" + "0" * 32, conf, run_state,
                       {k: [TaskState(s, 1, 2) for s in v] for k, v in tasks.items()})


def test_the_api_shows_the_cost_so_far_and_then_batch_jsons() -> None:
    running = _snap("running", validate=["success"], dispatch=["running"])
    running.live_counts, running.live_usage = (10, 4, 0), USAGE
    shown = batch_object(running, prices=PRICES)
    assert shown["usage"] == USAGE and shown["aibrix_cost"] == cost_line(USAGE, PRICES)
    assert batch_object(running)["aibrix_cost"] is None  # a deployment without prices
    done = _snap("success")
    done.batch_json = {"status": "completed", "usage": USAGE, "aibrix_cost": {"total": 9.0},
                       "request_counts": {"total": 1, "completed": 1, "failed": 0}}
    assert batch_object(done, prices=PRICES)["aibrix_cost"] == {"total": 9.0}  # the batch's own line


def test_the_cli_and_the_eval_report_say_what_it_cost() -> None:
    sdk_batch = Batch.model_validate({
        "id": "batch_1", "object": "batch", "endpoint": "/v1/chat/completions", "input_file_id": "file-x",
        "completion_window": "24h", "status": "in_progress", "created_at": 1,
        "request_counts": {"total": 10, "completed": 4, "failed": 0}, "usage": USAGE,
        "aibrix_cost": cost_line(USAGE, PRICES)})
    text = describe_batch(sdk_batch)
    assert "usage      3000000 input (1000000 cached) + 2000000 output tokens so far" in text, text
    assert "cost       4.250000 EUR (input 1.000000, cached input 0.250000, output 3.000000; 33.3 %" in text
    from aibrix_operators.evaluation.report import ReportData

    data = ReportData(suite="s", date="2026-12-06", model="m", scorer="exact",
                      interval=Interval(0.5, 0.4, 0.6, 10, 0.95), comparisons=[], history=[],
                      usage=USAGE, cost=cost_line(USAGE, PRICES))
    spend = ("The night's batch: 3000000 input tokens (1000000 cached), 2000000 output tokens; "
             "cost 4.250000 EUR")
    assert spend in render_markdown(data)
    assert "cost 4.250000 EUR" in render_html(data, b"")
    data.cost = None
    assert "(no prices set: no cost)" in render_markdown(data)
