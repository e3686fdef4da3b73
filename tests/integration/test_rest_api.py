"""Trigger batch_inference through a running Airflow's REST API (api-server + scheduler)."""

from __future__ import annotations

import json
import time

import pytest

from tests.integration.conftest import SERVED_NAME, chat_requests, read_jsonl, write_jsonl
from tests.integration.services import start_airflow


@pytest.fixture
def airflow(airflow_session_env, tmp_path_factory):
    home = tmp_path_factory.mktemp("airflow-rest")
    env = {**airflow_session_env, "AIRFLOW_HOME": str(home)}
    deployment = start_airflow(env, home)
    try:
        yield deployment
    finally:
        deployment.stop()


def test_rest_api_triggers_a_batch_run(airflow, vllm_chat, tmp_path):
    requests = chat_requests(12)
    input_path = write_jsonl(tmp_path / "input.jsonl", requests)
    out = tmp_path / "out"
    token = airflow.token()

    deadline = time.monotonic() + 120
    while True:  # the dag-processor parses the DAG folder shortly after start
        try:
            airflow.api("PATCH", "/api/v2/dags/batch_inference", {"is_paused": False}, token)
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)

    run = airflow.api("POST", "/api/v2/dags/batch_inference/dagRuns", {
        "logical_date": None,
        "conf": {"input_uri": str(input_path), "output_uri": str(out), "endpoint": vllm_chat.base_url,
                 "model": SERVED_NAME, "requests_per_shard": 5},
    }, token)
    run_id = run["dag_run_id"]

    deadline = time.monotonic() + 300
    state = run["state"]
    while state not in ("success", "failed") and time.monotonic() < deadline:
        time.sleep(2)
        state = airflow.api("GET", f"/api/v2/dags/batch_inference/dagRuns/{run_id}", token=token)["state"]
    assert state == "success", f"run ended {state}"

    # The merge task's XCom carries the batch object for API clients.
    xcom = airflow.api(
        "GET", f"/api/v2/dags/batch_inference/dagRuns/{run_id}/taskInstances/merge/xcomEntries/return_value",
        token=token,
    )
    value = xcom["value"] if isinstance(xcom["value"], dict) else json.loads(xcom["value"])
    assert value["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    output = read_jsonl((out / "output.jsonl").read_text())
    assert [r["custom_id"] for r in output] == [r["custom_id"] for r in requests]
