"""A batch's lifecycle has one home (batch/lifecycle.py): its statuses, steps and Batch object."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from aibrix_operators.batch.lifecycle import BatchStatus, RunSnapshot, Step, TaskState, batch_status
from aibrix_operators.batch.records import BatchObject
from aibrix_operators.batch_api import extensions
from aibrix_operators.batch_api.schemas import Batch
from aibrix_operators.batch_api.status import batch_object

REPO = Path(__file__).resolve().parents[2]
# Statuses that are nothing but batch statuses (``failed``/``completed`` are also task states
# and count keys, so they stay legal as words elsewhere).
ONLY_STATUSES = {BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING,
                 BatchStatus.CANCELLING}  # fmt: skip


# The API's fields beside OpenAI's, added where a batch is answered (batch_api/app.py), never stored.
# Not OpenAI's: the run's page, and the extension fields (batch_api/extensions.py: the in-progress
# outlook, a cut-short batch's unanswered count, the partial output and the shards done).
API_EXTRAS = {"monitor_url", *(v for k, v in vars(extensions).items() if k.isupper())}


@pytest.mark.service
def test_one_batch_object_in_the_api_the_store_and_the_status_mapping() -> None:
    stored = BatchObject(id="batch_x", endpoint="/v1/chat/completions", input_file_id="f").as_dict()
    shown = batch_object(RunSnapshot("batch_x", {}, "running"))
    openai_fields = [f for f in Batch.model_fields if f not in API_EXTRAS]
    shown_openai = [f for f in shown if f not in API_EXTRAS]
    assert set(openai_fields) == set(stored) == set(shown_openai)
    assert shown_openai == openai_fields  # OpenAI's order
    assert API_EXTRAS <= set(Batch.model_fields)
    assert set(Batch.model_json_schema()["$defs"]["BatchStatus"]["enum"]) == set(BatchStatus)


def test_status_follows_the_steps() -> None:
    def snap(**tasks: str) -> RunSnapshot:
        return RunSnapshot("b", {}, "running", {k: [TaskState(v)] for k, v in tasks.items()})

    assert batch_status(snap()) == BatchStatus.VALIDATING
    assert batch_status(snap(**{Step.VALIDATE: "success"})) == BatchStatus.IN_PROGRESS
    finalizing = snap(**{Step.VALIDATE: "success", Step.DISPATCH: "success", Step.MERGE: "running"})
    assert batch_status(finalizing) == BatchStatus.FINALIZING
    assert batch_status(RunSnapshot("b", {}, "success", batch_json={"status": "expired"})) == "expired"


def test_status_words_are_spelled_only_in_the_lifecycle() -> None:
    found = []
    for path in [*(REPO / "plugins").rglob("*.py"), *(REPO / "dags").rglob("*.py")]:
        if path.name == "lifecycle.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in ONLY_STATUSES:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert found == []


def test_the_pipelines_tasks_are_the_steps(monkeypatch) -> None:
    import importlib.util
    import os

    os.environ.setdefault("AIRFLOW_HOME", str(REPO / ".work" / "airflow-unit"))

    def tasks() -> set[str]:
        spec = importlib.util.spec_from_file_location("steps_dag", REPO / "dags" / "batch_inference.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert all(type(t) is str for t in module.dag.task_dict)  # plain ids, not enum members
        return set(module.dag.task_dict)

    # Where the deployment scales serving roles every step is a task; without roles the three
    # scaling steps are not in the DAG (operators/pipeline.py).
    roles = '{"decode": {"kind": "StormService", "name": "llm"}}'
    monkeypatch.setenv("AIRFLOW__AIBRIX_SCALING__ROLES", roles)
    assert tasks() == {str(s) for s in Step}
    monkeypatch.delenv("AIRFLOW__AIBRIX_SCALING__ROLES")
    scaling = {Step.ROLES_READY, Step.AUTOSCALE, Step.SCALE_DOWN}
    assert tasks() == {str(s) for s in Step if s not in scaling}
