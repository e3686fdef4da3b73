"""Record shapes, completion windows, the batch steps in job.py and batch.json."""

from __future__ import annotations

import json
import time

import pytest

from aibrix_operators.batch.job import (
    ValidatedBatch,
    finalize_batch,
    split_batch,
    validate_batch,
    work_prefix,
)
from aibrix_operators.batch.jsonfast import dumps
from aibrix_operators.batch.merging import ExactlyOnceViolation
from aibrix_operators.batch.records import (
    BatchObject,
    Usage,
    error_record,
    parse_completion_window,
    success_record,
)
from aibrix_operators.batch.shard_results import ResultLog, results_prefix, shard_result_log
from aibrix_operators.batch.validation import ValidationLimits
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.progress import ProgressReporter

# OpenAI's Batch object fields (https://platform.openai.com/docs/api-reference/batch/object)
BATCH_KEYS = {
    "id", "object", "endpoint", "errors", "input_file_id", "completion_window", "status",
    "output_file_id", "error_file_id", "created_at", "in_progress_at", "expires_at",
    "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at",
    "request_counts", "usage", "metadata",
    "model",  # OpenAI's Batch object has it; batch.json and the Batch API now both carry it
}


@pytest.mark.parametrize("window, seconds", [("24h", 86400), ("90m", 5400), ("3600s", 3600), ("1h", 3600)])
def test_parse_completion_window(window, seconds):
    assert parse_completion_window(window) == seconds


@pytest.mark.parametrize("window", ["", "24", "h", "1d", "-1h", "0h", "1.5h", "24 h", "abc"])
def test_parse_completion_window_rejects(window):
    with pytest.raises(ValueError, match="completion_window"):
        parse_completion_window(window)


def test_success_and_error_record_shapes():
    ok = success_record("c1", 200, "rid", {"x": 1})
    assert ok["custom_id"] == "c1" and ok["error"] is None
    assert ok["response"] == {"status_code": 200, "request_id": "rid", "body": {"x": 1}}
    err = error_record("c2", "http_400", "bad", 400, "rid2", {"error": {}})
    assert err["error"] == {"code": "http_400", "message": "bad"}
    assert err["response"] == {"status_code": 400, "request_id": "rid2", "body": {"error": {}}}
    assert error_record("c3", "timeout", "slow")["response"] is None
    assert ok["id"] != err["id"]
    assert list(ok) == ["id", "custom_id", "response", "error"]


def test_usage_totals():
    u = Usage()
    u.add_response_body({"usage": {"prompt_tokens": 5, "completion_tokens": 7,
                                   "prompt_tokens_details": {"cached_tokens": 2}}})
    u.add_response_body({"usage": {"prompt_tokens": 1}})  # embeddings: no completion tokens
    u.add_response_body("not a dict")
    u.add_response_body({"no": "usage"})
    assert u.as_dict() == {"input_tokens": 6, "input_tokens_details": {"cached_tokens": 2},
                           "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 0},
                           "total_tokens": 13}


def test_batch_object_has_openai_fields():
    obj = BatchObject(id="batch_1", endpoint="/v1/chat/completions", input_file_id="in.jsonl")
    d = obj.as_dict()
    assert set(d) == BATCH_KEYS
    assert d["object"] == "batch" and d["id"] == "batch_1" and d["status"] == "validating"
    assert d["request_counts"] == {"total": 0, "completed": 0, "failed": 0}


def test_work_prefix_is_path_safe():
    assert work_prefix("s3://b/out", "manual__2024-01-01T00:00:00+00:00") == \
        "s3://b/out/_work/manual__2024-01-01T00_00_00_00_00"


def test_failed_validation_writes_failed_batch_json(storage, write_file, tmp_path, line):
    uri = write_file(line("a") + line("a") + line("b", method="GET"))
    out = str(tmp_path / "out")
    report, batch = validate_batch(storage, uri, out, limits=ValidationLimits(),
                                   completion_window="2h", metadata={"k": "v"}, batch_id="batch_x")
    assert batch is None and not report.ok
    doc = json.loads((tmp_path / "out" / "batch.json").read_text())
    assert set(doc) == BATCH_KEYS
    assert doc["status"] == "failed" and doc["id"] == "batch_x"
    assert doc["failed_at"] is not None and doc["expires_at"] - doc["created_at"] == 7200
    assert doc["request_counts"]["total"] == 3
    assert doc["metadata"] == {"k": "v"}
    assert doc["errors"]["object"] == "list" and doc["errors"]["total"] == 2
    assert {(e["line"], e["code"]) for e in doc["errors"]["data"]} == {
        (2, "duplicate_custom_id"), (3, "invalid_method")}


def test_expected_model_mismatch_fails_validation(storage, write_file, tmp_path, lines):
    uri = write_file(lines(2))
    report, batch = validate_batch(storage, uri, str(tmp_path / "out"), expected_model="other")
    assert batch is None
    assert [e.code for e in report.errors] == ["mismatched_model"]


def test_bad_completion_window_is_recorded_before_reading(storage, tmp_path):
    # The input does not exist: the window is checked first, so that is the one error.
    report, batch = validate_batch(storage, str(tmp_path / "absent.jsonl"), str(tmp_path / "o"),
                                   completion_window="soon")
    assert batch is None
    assert [(e.code, e.param) for e in report.errors] == [("invalid_completion_window", "completion_window")]
    written = json.loads((tmp_path / "o" / "batch.json").read_text())
    assert written["status"] == "failed"
    assert written["errors"]["data"][0]["code"] == "invalid_completion_window"


def test_batch_steps_and_batch_json(storage, write_file, tmp_path, lines):
    uri = write_file(lines(7))
    out = str(tmp_path / "out")
    report, batch = validate_batch(storage, uri, out, completion_window="24h",
                                   metadata={"team": "a"}, batch_id="batch_ok")
    assert report.ok and batch is not None
    assert ValidatedBatch.from_dict(json.loads(json.dumps(batch.as_dict()))) == batch
    work = work_prefix(out, "run-1")
    shards = split_batch(storage, batch, work, requests_per_shard=3, bytes_per_shard=1 << 20, max_shards=10)
    assert [s.num_requests for s in shards] == [3, 3, 1]
    for s in shards:
        log = shard_result_log(storage, results_prefix(work, s.name), s.uri)
        for raw in storage.read_bytes(s.uri).splitlines():
            cid = json.loads(raw)["custom_id"]
            if cid == "req-4":
                log.append(dumps(error_record(cid, "timeout", "too slow")))
            else:
                log.append(dumps(success_record(cid, 200, "r", {"usage": {
                    "prompt_tokens": 10, "completion_tokens": 4}})))
        log.flush()
    before = int(time.time())
    summary, obj = finalize_batch(storage, batch, shards, work, in_progress_at=before)
    doc = json.loads((tmp_path / "out" / "batch.json").read_text())
    assert doc == json.loads(json.dumps(obj.as_dict()))
    assert set(doc) == BATCH_KEYS
    assert doc["status"] == "completed" and doc["id"] == "batch_ok" and doc["object"] == "batch"
    assert doc["endpoint"] == "/v1/chat/completions" and doc["input_file_id"] == uri
    assert doc["request_counts"] == {"total": 7, "completed": 6, "failed": 1}
    assert doc["usage"]["input_tokens"] == 60 and doc["usage"]["output_tokens"] == 24
    assert doc["usage"]["total_tokens"] == 84
    assert doc["output_file_id"].endswith("output.jsonl") and doc["error_file_id"].endswith("errors.jsonl")
    assert doc["created_at"] <= doc["in_progress_at"] <= doc["finalizing_at"] <= doc["completed_at"]
    assert doc["expires_at"] == doc["created_at"] + 86400
    assert doc["metadata"] == {"team": "a"} and doc["errors"] is None
    out_lines = (tmp_path / "out" / "output.jsonl").read_bytes().splitlines()
    out_ids = [json.loads(x)["custom_id"] for x in out_lines]
    assert out_ids == ["req-0", "req-1", "req-2", "req-3", "req-5", "req-6"]
    # a shard whose results went missing fails the finalize step loudly
    for seg in shard_result_log(storage, results_prefix(work, shards[1].name), shards[1].uri).segments():
        (tmp_path / seg).unlink()
    with pytest.raises(ExactlyOnceViolation):
        finalize_batch(storage, batch, shards, work)


def test_result_log_flushes_whole_segments_in_order(storage, tmp_path):
    prefix = str(tmp_path / "res")
    log = ResultLog(storage, prefix, "b1", flush_interval_s=3600, flush_every=2)
    assert not log.due() and log.take_segment() is None
    log.append(dumps(success_record("a", 200, "r", {})))
    assert not log.due()
    log.append(dumps(success_record("b", 200, "r", {})))
    assert log.due()
    log.flush()
    log.append(dumps(success_record("c", 200, "r", {})))
    log.flush()
    later = ResultLog(storage, prefix, "b1")  # a restarted driver's log sorts after
    later.append(dumps(success_record("d", 200, "r", {})))
    later.flush()
    assert [cid for cid, _ in ResultLog(storage, prefix, "b1").iter_records()] == ["a", "b", "c", "d"]
    assert ResultLog(storage, prefix, "b1").done_ids() == {"a", "b", "c", "d"}
    assert len(log.segments()) == 3
    # another binding (another shard content) sees none of them
    assert ResultLog(storage, prefix, "b2").done_ids() == set()


def test_driver_config():
    assert DriverConfig("http://h:1/v1/").base_url == "http://h:1"
    assert DriverConfig("http://h:1").base_url == "http://h:1"
    for bad in ({"endpoint": "h:1"}, {"endpoint": "http://h", "concurrency": 0},
                {"endpoint": "http://h", "max_attempts": 0}):
        with pytest.raises(ValueError):
            DriverConfig(**bad)


def test_driver_config_reads_api_key_from_env(monkeypatch):
    monkeypatch.setenv("MY_KEY", "sk-test")
    monkeypatch.setenv("MY_KEY_ORIGIN", "http://h")  # the key is bound to this origin (trust.py)
    cfg = DriverConfig("http://h", api_key_env="MY_KEY", extra_headers={"X-A": "1"})
    assert cfg.headers() == {"Content-Type": "application/json", "X-A": "1",
                             "Authorization": "Bearer sk-test"}
    monkeypatch.delenv("MY_KEY")
    assert "Authorization" not in cfg.headers()


def test_progress_line_has_rate_and_eta():
    p = ProgressReporter("shard-00000", total=100, interval_s=1, already_done=20)
    p.started -= 10  # ten seconds ago
    text = p.line(completed=15, failed=5)
    assert "40/100 (40.0%)" in text and "resumed=20" in text
    assert "rate=2.0 req/s" in text and "eta=30s" in text
    assert "eta=?" in ProgressReporter("s", 5, 1).line(0, 0)
