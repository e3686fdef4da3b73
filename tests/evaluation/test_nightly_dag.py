"""nightly_eval__<suite> DAGs: one per suite, schedules from the config, and the batch step is
wired exactly like batch_inference (same operator classes, same edges) — no second path."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.service

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("AIRFLOW_HOME", str(REPO / ".work" / "airflow-unit"))


def _load(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "dags" / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dags():
    module = _load("nightly_eval_dag", "nightly_eval.py")
    return {k: v for k, v in vars(module).items() if k.startswith("nightly_eval__")}


def test_one_dag_per_suite_with_its_schedule(dags):
    assert set(dags) >= {"nightly_eval__arithmetic", "nightly_eval__multiple_choice",
                         "nightly_eval__short_answer"}
    arith = dags["nightly_eval__arithmetic"]
    assert arith.catchup is False
    assert arith.schedule == "0 2 * * *"
    assert dags["nightly_eval__multiple_choice"].schedule == "30 2 * * *"
    assert arith.params.get_param("model").schema["enum"] == ["eval-llama"]


def test_a_suite_with_on_assets_runs_on_its_cron_or_an_asset_event(dags):
    """config/eval_suites.yaml: reverse_facts runs weekly and whenever its adapter is published."""
    from airflow.sdk import AssetOrTimeSchedule

    timetable = dags["nightly_eval__reverse_facts"].timetable
    assert isinstance(timetable, AssetOrTimeSchedule), timetable
    assert timetable.timetable.expression == "30 3 * * 1"
    assert [a.name for a in timetable.asset_condition.objects] == ["aibrix-lora://eval-llama-reverse"]
    assert not isinstance(dags["nightly_eval__arithmetic"].timetable, AssetOrTimeSchedule)


def test_flow_render_batch_evaluate_report_gate(dags):
    dag = dags["nightly_eval__arithmetic"]
    t = dag.task_dict
    assert t["batch.validate"].upstream_task_ids == {"render"}
    assert t["evaluate"].upstream_task_ids == {"batch.merge", "render"}
    assert t["report"].upstream_task_ids == {"evaluate", "render"}
    assert t["regression_gate"].upstream_task_ids == {"report", "evaluate"}


def test_batch_group_is_wired_like_batch_inference(dags):
    batch = _load("batch_inference_dag", "batch_inference.py").dag
    evald = dags["nightly_eval__arithmetic"]
    for task_id, task in batch.task_dict.items():
        twin = evald.task_dict[f"batch.{task_id}"]
        assert type(twin) is type(task), task_id
        assert twin.trigger_rule == task.trigger_rule, task_id
        assert {f"batch.{u}" for u in task.upstream_task_ids} == twin.upstream_task_ids - {"render"}, task_id
    assert evald.task_dict["batch.record_failure"].validate_task_id == "batch.validate"
