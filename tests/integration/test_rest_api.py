"""Trigger batch_inference through a running Airflow's REST API (api-server + scheduler)."""

from __future__ import annotations

import json
import re

import pytest

from aibrix_operators.local_airflow import start_airflow, trigger_and_wait
from tests.integration.conftest import SERVED_NAME, chat_requests, read_jsonl, write_jsonl

pytestmark = pytest.mark.e2e


@pytest.fixture
def airflow(airflow_session_env, tmp_path_factory):
    home = tmp_path_factory.mktemp("airflow-rest")
    env = {**airflow_session_env, "AIRFLOW_HOME": str(home)}
    with start_airflow(env, home) as deployment:
        yield deployment


def test_rest_api_triggers_a_batch_run(airflow, vllm_chat, tmp_path):
    requests = chat_requests(12)
    input_path = write_jsonl(tmp_path / "input.jsonl", requests)
    out = tmp_path / "out"
    run = trigger_and_wait(airflow, "batch_inference", {
        "input_uri": str(input_path), "output_uri": str(out), "endpoint": vllm_chat.base_url,
        "model": SERVED_NAME, "requests_per_shard": 5,
    }, timeout_s=300)
    assert run["state"] == "success", airflow.failure_report("batch_inference", run["dag_run_id"])
    run_id = run["dag_run_id"]
    token = airflow.token()

    # The merge task's XCom carries the batch object for API clients.
    xcom = airflow.api(
        "GET", f"/api/v2/dags/batch_inference/dagRuns/{run_id}/taskInstances/merge/xcomEntries/return_value",
        token=token,
    )
    value = xcom["value"] if isinstance(xcom["value"], dict) else json.loads(xcom["value"])
    assert value["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    output = read_jsonl((out / "output.jsonl").read_text())
    assert [r["custom_id"] for r in output] == [r["custom_id"] for r in requests]

    # No task's start waited on the execution API's first-request build (local_airflow's
    # warm_execution_api): without it the first task's start took 6.6-13.7 s in the suite, and
    # 9.5 s alone, past the task SDK's 5 s timeout ([workers] execution_api_timeout).
    log = (airflow.home / "component-logs" / "api-server.log").read_text()
    starts = [int(us) / 1e6 for us in re.findall(
        r"duration_us=(\d+) loc=\S+ method=PATCH path=/execution/task-instances/\S+/run ", log)]
    assert starts and max(starts) < 5.0, starts
