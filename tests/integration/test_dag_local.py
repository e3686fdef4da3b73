"""batch_inference end to end: `airflow dags test` → real vLLM CPU server → local files."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.integration.conftest import SERVED_NAME, chat_requests, dags_test, read_jsonl, write_jsonl

pytestmark = pytest.mark.e2e


def assert_chat_completion(record: dict) -> None:
    assert set(record) == {"id", "custom_id", "response", "error"}
    assert record["error"] is None
    response = record["response"]
    assert response["status_code"] == 200
    assert response["request_id"]
    body = response["body"]
    assert body["object"] == "chat.completion"
    assert body["model"] == SERVED_NAME
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(body["choices"][0]["message"]["content"], str)
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0
    assert usage["completion_tokens"] == 8  # max_tokens on a random model: never stops early
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def _prompt_tokens_served(url: str) -> float:
    """vLLM's own prompt-token counter, from its /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_total"))


def test_dag_answers_every_request_once_in_input_order(vllm_chat, tiny_model, airflow_session_env, tmp_path):
    requests = chat_requests(45)
    input_path = write_jsonl(tmp_path / "input.jsonl", requests)
    # First a dry run (the dry_run param) with the deployment naming the model's tokenizer: it sends
    # nothing, and the input tokens it counts are the ones vLLM reports below (issue 40.3).
    dry_out = tmp_path / "dry"
    before = _prompt_tokens_served(vllm_chat.base_url)
    proc = dags_test({**airflow_session_env, "AIRFLOW__AIBRIX_BATCH__TOKENIZERS": json.dumps(
        {SERVED_NAME: str(tiny_model)})}, {"input_uri": str(input_path), "output_uri": str(dry_out),
        "endpoint": vllm_chat.base_url, "model": SERVED_NAME, "dry_run": True}, tmp_path / "dry-logs")
    assert proc.returncode == 0, proc.stdout[-5000:]
    estimate = json.loads((dry_out / "estimate.json").read_text())
    basis = f"counted with the model's tokenizer ({tiny_model}), every request"
    assert estimate["input_tokens_basis"] == basis
    assert _prompt_tokens_served(vllm_chat.base_url) == before, "the dry run sent nothing"
    out = tmp_path / "out"
    proc = dags_test(airflow_session_env, {
        "input_uri": str(input_path), "output_uri": str(out), "endpoint": vllm_chat.base_url,
        "requests_per_shard": 20, "concurrency": 8, "model": SERVED_NAME,
    }, tmp_path)
    assert proc.returncode == 0, proc.stdout[-5000:]

    output = read_jsonl((out / "output.jsonl").read_text())
    assert (out / "errors.jsonl").read_text() == ""
    assert [r["custom_id"] for r in output] == [r["custom_id"] for r in requests]
    for record in output:
        assert_chat_completion(record)

    batch = json.loads((out / "batch.json").read_text())
    assert batch["object"] == "batch" and batch["status"] == "completed"
    assert batch["endpoint"] == "/v1/chat/completions"
    assert batch["request_counts"] == {"total": 45, "completed": 45, "failed": 0}
    prompt_tokens = sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in output)
    assert batch["usage"]["input_tokens"] == prompt_tokens
    assert estimate["work"]["input_tokens"] == prompt_tokens  # the dry run's count, exact
    assert batch["usage"]["output_tokens"] == 45 * 8
    assert batch["created_at"] <= batch["in_progress_at"] <= batch["finalizing_at"] <= batch["completed_at"]
    # Three shards of ≤20 requests ran as three mapped tasks, each logging progress.
    shard_dirs = sorted(p.name for p in (next((out / "_work").iterdir()) / "results").iterdir())
    assert shard_dirs == ["shard-00000", "shard-00001", "shard-00002"]
    assert proc.stdout.count("done shard-0000") == 3


def test_invalid_file_fails_before_inference_with_line_numbers(vllm_chat, airflow_session_env, tmp_path):
    requests = chat_requests(5)
    requests[3]["custom_id"] = requests[1]["custom_id"]
    lines = [json.dumps(r) for r in requests]
    lines.insert(2, "{not json")
    input_path = tmp_path / "bad.jsonl"
    input_path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    proc = dags_test(airflow_session_env, {
        "input_uri": str(input_path), "output_uri": str(out), "endpoint": vllm_chat.base_url,
    }, tmp_path)
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    assert "line 3: [invalid_json_line]" in log
    assert "line 5: [duplicate_custom_id]" in log

    batch = json.loads((out / "batch.json").read_text())
    assert batch["status"] == "failed"
    assert {(e["line"], e["code"]) for e in batch["errors"]["data"]} == {
        (3, "invalid_json_line"), (5, "duplicate_custom_id"),
    }
    # Nothing was split, sent or written: the batch failed before inference.
    assert not (out / "_work").exists()
    assert not (out / "output.jsonl").exists()


def test_wrong_endpoint_parameter_is_a_clear_error(airflow_session_env, tmp_path):
    input_path = write_jsonl(tmp_path / "input.jsonl", chat_requests(3))
    out = tmp_path / "out"
    proc = dags_test(airflow_session_env, {
        "input_uri": str(input_path), "output_uri": str(out), "endpoint": "http://127.0.0.1:9",
        "batch_endpoint": "/v1/embeddings",
    }, tmp_path)
    assert proc.returncode != 0
    batch = json.loads((out / "batch.json").read_text())
    assert {e["code"] for e in batch["errors"]["data"]} == {"mismatched_endpoint"}
    assert Path(out / "output.jsonl").exists() is False


def test_failure_after_validation_is_recorded_in_batch_json(vllm_chat, airflow_session_env, tmp_path):
    input_path = write_jsonl(tmp_path / "input.jsonl", chat_requests(4, model="not-served"))
    out = tmp_path / "out"
    proc = dags_test(airflow_session_env, {
        "input_uri": str(input_path), "output_uri": str(out), "endpoint": vllm_chat.base_url,
    }, tmp_path)
    assert proc.returncode != 0
    assert "'not-served' is not served at" in proc.stdout + proc.stderr
    batch = json.loads((out / "batch.json").read_text())
    assert batch["status"] == "failed"
    # The dispatch tasks' own error, not a generic one (operators/step_errors.py).
    assert [e["code"] for e in batch["errors"]["data"]] == ["model_not_served"]
    assert "'not-served' is not served at" in batch["errors"]["data"][0]["message"]
    assert batch["request_counts"]["total"] == 4
    assert not (out / "output.jsonl").exists()
