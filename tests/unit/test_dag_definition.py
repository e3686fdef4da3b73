"""The batch_inference DAG parses, is wired as documented, and its trigger form is usable."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Airflow reads AIRFLOW_HOME on import; keep it out of the user's home directory.
os.environ.setdefault("AIRFLOW_HOME", str(REPO / ".work" / "airflow-unit"))


@pytest.fixture(scope="module")
def dag():
    # As parsed where the deployment scales serving roles (tests/unit/test_pipeline.py: without
    # roles the three scaling tasks are not in the DAG).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIRFLOW__AIBRIX_SCALING__ROLES", '{"decode": {"kind": "StormService", "name": "llm"}}')
        spec = importlib.util.spec_from_file_location("batch_inference_dag",
                                                      REPO / "dags" / "batch_inference.py")  # fmt: skip
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module.dag


def test_tasks_are_wired_validate_split_dispatch_merge(dag):
    assert set(dag.task_dict) == {"validate", "split", "dispatch", "merge", "record_failure",
                                  "roles_ready", "autoscale", "scale_down"}
    assert dag.task_dict["split"].upstream_task_ids == {"validate"}
    assert dag.task_dict["dispatch"].upstream_task_ids == {"validate", "split", "roles_ready"}
    assert dag.task_dict["merge"].upstream_task_ids == {"validate", "split", "dispatch"}
    assert dag.task_dict["record_failure"].trigger_rule == "one_failed"
    assert dag.task_dict["record_failure"].upstream_task_ids == {"validate", "split", "dispatch", "merge"}
    # Scaling beside dispatch: merge never waits for it; scale_down runs whatever happened.
    assert dag.task_dict["autoscale"].upstream_task_ids == {"validate", "split", "roles_ready"}
    assert dag.task_dict["scale_down"].upstream_task_ids == {"merge", "autoscale"}
    assert dag.task_dict["scale_down"].trigger_rule == "all_done"


def test_every_param_has_a_type_and_the_form_needs_descriptions(dag):
    params = dag.params
    for name in ("input_uri", "output_uri", "endpoint", "model", "requests_per_shard", "concurrency",
                 "completion_window", "execution_mode", "metadata"):
        schema = params.get_param(name).schema
        assert "type" in schema, name
    described = [n for n in params if params.get_param(n).description]
    assert {"input_uri", "output_uri", "endpoint", "concurrency", "execution_mode"} <= set(described)


@pytest.mark.parametrize("name,value", [
    ("endpoint", "not-a-url"), ("concurrency", 0), ("execution_mode", "ssh"),
    ("completion_window", "tomorrow"), ("requests_per_shard", "many"),
])
def test_params_reject_bad_values(dag, name, value):
    from airflow.sdk.exceptions import ParamValidationError

    param = dag.params.get_param(name)
    param.resolve(param.value)  # the default is valid
    with pytest.raises(ParamValidationError):
        param.resolve(value)


def test_every_templated_argument_is_a_template_field(dag) -> None:
    # A "{{ ... }}" handed to an argument that is not in template_fields reaches the task verbatim.
    for task in dag.tasks:
        fields = set(task.template_fields)
        for name, value in vars(task).items():
            if isinstance(value, str) and "{{" in value:
                assert name in fields, f"{task.task_id}.{name} is templated but not a template field"


def test_dispatch_retries_outlast_node_losses_and_the_salt_reaches_dispatch(dag) -> None:
    from aibrix_operators.scheduling.recovery import DEFAULT_DISPATCH_RETRIES

    dispatch = dag.task_dict["dispatch"]
    # Issue 19, finding 17: two retries were spent by two lost scheduler nodes.
    assert os.environ.get("AIRFLOW__AIBRIX_BATCH__DISPATCH_RETRIES") is None
    assert dispatch.retries == DEFAULT_DISPATCH_RETRIES == 6
    assert dispatch.partial_kwargs["cache_salt"] == "{{ params.cache_salt }}"
