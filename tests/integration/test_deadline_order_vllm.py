"""Batches on one worker slot finish in deadline order, in shared mode against a priority-scheduled
vLLM CPU server (deadline_order.py, slot_keeping_executor.py), and a run that insists on dedicated
mode on that shared endpoint fails with its reason.

In the parallel pass, not the serial one beside test_shared_capacity_vllm.py, whose server it used
to share: the order is the scheduler's choice among waiting tasks by weight, one at a time, which a
loaded machine slows but cannot reorder; alone, it held the serial pass (where nothing else runs)
for ~115 s of its ~290 s (2026-12-07 clean clone).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aibrix_operators.local_airflow import start_airflow
from aibrix_operators.serving.local_vllm import VLLMServer
from tests.integration import priority_vllm
from tests.integration.conftest import SERVED_NAME, chat_requests, most_at_once, read_jsonl, write_jsonl

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def vllm_priority(tiny_model: Path) -> Iterator[VLLMServer]:
    with VLLMServer(priority_vllm.priority_spec(tiny_model)) as server:
        yield server


def test_three_batches_submitted_together_finish_in_deadline_order(
    airflow_session_env: dict, vllm_priority: VLLMServer, tmp_path: Path,
) -> None:
    """One worker slot (parallelism 1), three batches queued at once, submitted latest deadline
    first: the cluster policy (deadline_order.py) runs the tight one first, then the moderate
    one, then the relaxed one, in shared mode against the priority-scheduled server. A fourth
    run that asks for dedicated mode on that shared endpoint fails with its reason."""
    home = tmp_path / "airflow"
    env = {**airflow_session_env, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__PARALLELISM": "1",
           "AIRFLOW__AIBRIX_BATCH__SHARED_ENDPOINTS": vllm_priority.base_url}
    deployment = start_airflow(env, home)
    try:
        token = deployment.token()
        # Parsed but still paused: the runs are queued first, all at once.
        deployment.set_paused("batch_inference", paused=True, token=token)
        runs: dict[str, str] = {}
        for name, window, mode in (("relaxed", "24h", ""), ("moderate", "2h", ""), ("tight", "20m", ""),
                                   ("insists_dedicated", "12h", "dedicated")):
            requests = chat_requests(4)
            conf = {"input_uri": str(write_jsonl(tmp_path / f"{name}.jsonl", requests)),
                    "output_uri": str(tmp_path / f"out-{name}"), "endpoint": vllm_priority.base_url,
                    "model": SERVED_NAME, "requests_per_shard": 2, "completion_window": window,
                    "capacity_mode": mode, "endpoint_wait_s": 5}
            run = deployment.api("POST", "/api/v2/dags/batch_inference/dagRuns",
                                 {"logical_date": None, "conf": conf}, token)
            runs[name] = run["dag_run_id"]
        deployment.unpause("batch_inference", token=token)
        deadline = time.monotonic() + 900
        states: dict[str, str] = {}
        while len(states) < len(runs):
            assert time.monotonic() < deadline, f"runs not finished: {states}"
            time.sleep(2)
            for name, run_id in runs.items():
                run = deployment.api("GET", f"/api/v2/dags/batch_inference/dagRuns/{run_id}", token=token)
                if run["state"] in ("success", "failed"):
                    states[name] = run["state"]
        merged_at = {}
        for name in ("tight", "moderate", "relaxed"):
            path = f"/api/v2/dags/batch_inference/dagRuns/{runs[name]}/taskInstances/merge"
            ti = deployment.api("GET", path, token=token)
            merged_at[name] = ti["end_date"]
        handed_out = []  # from queued (handed to the executor) to the end, every task of every run
        for run_id in runs.values():
            tis = deployment.api("GET", f"/api/v2/dags/batch_inference/dagRuns/{run_id}/taskInstances",
                                 token=token)["task_instances"]
            handed_out += [(t["queued_when"], t["end_date"]) for t in tis if t["queued_when"]]
    finally:
        deployment.stop()
    # One slot: a task is handed to the executor only once the one before it has ended, so the
    # scheduler chooses among all waiting tasks by weight (slot_keeping_executor.py). Airflow's
    # own LocalExecutor handed out every schedulable task at once, first come first served.
    assert most_at_once(handed_out) == 1, sorted(handed_out)
    assert states == {"relaxed": "success", "moderate": "success", "tight": "success",
                      "insists_dedicated": "failed"}
    assert sorted(merged_at, key=merged_at.get) == ["tight", "moderate", "relaxed"], merged_at
    for name in ("tight", "moderate", "relaxed"):
        output = read_jsonl((tmp_path / f"out-{name}" / "output.jsonl").read_text())
        assert sorted(r["custom_id"] for r in output) == [f"req-{i:04d}" for i in range(4)]
    refused = json.loads((tmp_path / "out-insists_dedicated" / "batch.json").read_text())
    error = refused["errors"]["data"][0]
    assert error["code"] == "capacity_mode_refused", refused
    assert "also serves online traffic" in error["message"]
