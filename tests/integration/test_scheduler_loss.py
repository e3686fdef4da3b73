"""A lost scheduler node, twice, in the middle of a batch (issue 19, finding 17).

A real Airflow (api-server, scheduler, dag-processor, triggerer; LocalExecutor) under the
deployment's recovery settings (aibrix_operators/scheduling/recovery.py) runs a two-shard batch
against a real vLLM. Twice, while both shards are mid-way (a gate in front of vLLM holds their
next requests), the scheduler and every task process below it are SIGKILLed and the scheduler
is started again, as compose's restart policy or a Deployment would. The run must succeed with
every request answered once, each loss must be noticed and the shards resumed within
``RECOVERY_BOUND_S``, and two losses must leave retries to spare.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from aibrix_operators.local_airflow import start_airflow, wait_until
from aibrix_operators.scheduling.recovery import DEFAULT_DISPATCH_RETRIES, RECOVERY_BOUND_S, RECOVERY_ENV
from tests.integration.conftest import SERVED_NAME, chat_requests, read_jsonl, write_jsonl
from tests.integration.gate_proxy import GateProxy

pytestmark = pytest.mark.e2e

DAG = "batch_inference"
REQUESTS = 240
PER_SHARD = 120
ANSWERED_BEFORE_EACH_LOSS = 60


@pytest.fixture
def airflow(airflow_session_env, tmp_path_factory):
    home = tmp_path_factory.mktemp("airflow-loss")
    env = {**airflow_session_env, "AIRFLOW_HOME": str(home)}
    assert all(env[k] == v for k, v in RECOVERY_ENV.items())  # the shipped settings, no test's own
    with start_airflow(env, home) as deployment:
        yield deployment


def _segments(out: Path) -> int:
    return len(list((out / "_work").rglob("seg-*.jsonl")))


def test_a_lost_scheduler_node_costs_a_minute_and_no_request_twice(airflow, vllm_chat, tmp_path):
    requests = chat_requests(REQUESTS, max_tokens=4)
    input_path = write_jsonl(tmp_path / "input.jsonl", requests)
    out = tmp_path / "out"
    token = airflow.token()
    wait_until(lambda: bool(airflow.api("PATCH", f"/api/v2/dags/{DAG}", {"is_paused": False}, token)),
               120, "the DAG to be parsed")  # fmt: skip
    with GateProxy(vllm_chat.base_url) as gate:
        gate.hold_after(ANSWERED_BEFORE_EACH_LOSS)
        run = airflow.api("POST", f"/api/v2/dags/{DAG}/dagRuns", {"logical_date": None, "conf": {
            "input_uri": str(input_path), "output_uri": str(out), "endpoint": gate.base_url,
            "model": SERVED_NAME, "requests_per_shard": PER_SHARD, "concurrency": 2,
        }}, token)  # fmt: skip
        run_path = f"/api/v2/dags/{DAG}/dagRuns/{run['dag_run_id']}"
        recoveries = []
        for _loss in range(2):
            assert gate.wait_held(300), "the shards never reached the gate"
            wait_until(lambda: _segments(out) > 0, 60, "a checkpoint before the loss")
            forwarded = gate.forwarded
            killed = airflow.lose("scheduler")
            assert len(killed) > 2, killed  # the scheduler, its executor and the task processes
            lost_at = time.monotonic()
            gate.drop_held()  # their senders are dead: never forwarded, never counted
            gate.hold_after(ANSWERED_BEFORE_EACH_LOSS)
            airflow.restart("scheduler")
            # Resumed: a new try of a dispatch task sends again.
            wait_until(lambda n=forwarded: gate.forwarded > n, RECOVERY_BOUND_S + 60, "a resumed shard")
            recoveries.append(time.monotonic() - lost_at)
        gate.release()
        deadline = time.monotonic() + 600
        while (run := airflow.api("GET", run_path, token=token))["state"] not in ("success", "failed"):
            assert time.monotonic() < deadline, f"run still {run['state']}"
            time.sleep(1)
    print(f"\nrecovery after each lost scheduler node: {[round(r, 1) for r in recoveries]} s")
    assert run["state"] == "success", run
    assert all(r <= RECOVERY_BOUND_S for r in recoveries), recoveries
    output = read_jsonl((out / "output.jsonl").read_text())
    assert [r["custom_id"] for r in output] == [r["custom_id"] for r in requests]  # each once, in order
    assert (out / "errors.jsonl").read_text() == ""
    tis = airflow.api("GET", f"{run_path}/taskInstances", token=token)["task_instances"]
    tries = sorted(ti["try_number"] for ti in tis if ti["task_id"] == "dispatch")
    assert len(tries) == 2 and max(tries) <= 3, tries  # two losses: at most two retries each
    assert max(tries) < DEFAULT_DISPATCH_RETRIES + 1  # with retries to spare
