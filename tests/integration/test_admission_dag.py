"""Admission through Airflow (issue 40): a first batch on an endpoint is admitted with "no measurement
yet" and, at merge, teaches the deployment the endpoint's rate; a batch whose window that rate cannot
meet is then refused in validation (the deployment refuses such windows), naming the shortest window
that would be met; a dry run of it (the dry_run param) says the same and sends nothing; a batch with
that window is admitted with an estimate, kept in its batch.json.
`airflow dags test` against the fake OpenAI server (which reports vLLM's token counters)."""

from __future__ import annotations

import json

import pytest

from aibrix_operators.batch.admission import endpoint_key, read_rate
from aibrix_operators.storage import LocalStorage
from tests.integration.conftest import SERVED_NAME, chat_requests, dags_test, write_jsonl

pytestmark = pytest.mark.e2e


def test_a_measured_rate_refuses_a_window_it_cannot_meet_and_admits_one_it_can(
        fake, airflow_session_env, tmp_path):
    state = tmp_path / "state"
    env = {**airflow_session_env, "AIRFLOW__AIBRIX_BATCH__STATE_ROOT": str(state),
           "AIRFLOW__AIBRIX_BATCH__ADMISSION": "refuse"}

    def run(name: str, n: int, window: str, delay: str = "0.02") -> dict:
        requests = chat_requests(n)
        for r in requests:
            r["body"]["fault"] = [f"ok@{delay}"]
        out = tmp_path / name
        dags_test(env, {"input_uri": str(write_jsonl(tmp_path / f"{name}.jsonl", requests)),
                        "output_uri": str(out), "endpoint": fake.url, "model": SERVED_NAME,
                        "concurrency": 2, "completion_window": window}, tmp_path / f"{name}-logs")
        return json.loads((out / "batch.json").read_text())

    first = run("first", 60, "1h")  # 60 answers, 2 at a time, 20 ms each: about 0.6 s of sending
    assert first["status"] == "completed", first
    assert "no measurement yet" in first["aibrix_estimate"]["basis"]
    rate = read_rate(LocalStorage(), str(state), endpoint_key(SERVED_NAME, fake.url))
    assert rate is not None and rate.batches == 1
    # Measured on the endpoint's own counters: 8 tokens an answer, 100 answers a second at most.
    assert 0 < rate.tokens_per_s <= 8 * 100 * 1.1, rate
    assert rate.output_tokens_per_request == 3.0

    refused = run("refused", 1000, "2s")  # about 10 s of work at that rate
    assert refused["status"] == "failed"
    [error] = refused["errors"]["data"]
    assert error["code"] == "window_infeasible" and error["param"] == "completion_window", error
    window = error["message"].rsplit("ask for completion_window ", 1)[1].split(" ")[0]
    assert window.endswith("m"), error["message"]
    assert sum(fake.counts().values()) == 60 + 0, "the refused batch sent nothing"

    # A dry run of the same batch (the DAG's dry_run param): the run succeeds with its estimate in
    # estimate.json, nothing split, sent or queued, and no batch.json (no batch was made).
    dry_out = tmp_path / "dry"
    proc = dags_test({**env, "AIRFLOW__AIBRIX_BATCH__PRICES": "input=1.0,output=2.0,currency=USD"},
                     {"input_uri": str(tmp_path / "refused.jsonl"), "output_uri": str(dry_out),
                      "endpoint": fake.url, "model": SERVED_NAME, "completion_window": "2s", "dry_run": True},
                     tmp_path / "dry-logs")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads((dry_out / "estimate.json").read_text())
    assert answer["work"]["requests"] == 1000 and answer["work"]["max_output_tokens"] == 1000 * 8
    assert answer["estimate"]["feasible"] is False and answer["estimate"]["earliest_window"] == window
    assert answer["cost"]["currency"] == "USD" and answer["cost"]["total"] > 0, answer["cost"]
    assert not (dry_out / "batch.json").exists() and not any((state / "queue").rglob("*.json"))
    assert sum(fake.counts().values()) == 60, "the dry run sent nothing"

    admitted = run("admitted", 200, window, delay="0.005")
    assert admitted["status"] == "completed"
    estimate = admitted["aibrix_estimate"]
    assert estimate["feasible"] is True and estimate["tokens"] > 200 * 8  # bounded by max_tokens 8
    assert estimate["completion_at"] <= admitted["expires_at"]
    # Its merge taught the rate a second batch, and took its work off the queue.
    assert read_rate(LocalStorage(), str(state), endpoint_key(SERVED_NAME, fake.url)).batches == 2
    assert not any((state / "queue").rglob("*.json"))
