"""batch_inference and the nightly eval's batch group are one pipeline (operators/pipeline.py).

The eval's copy of the wiring once drifted (hard-coded limits, no prefix grouping, an empty
namespace): here the two are compared task by task and argument by argument, so a param added
to one and not the other fails.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("AIRFLOW_HOME", str(REPO / ".work" / "airflow-unit"))
PARAM_TEMPLATE = re.compile(r"^\{\{ params\.(\w+) \}\}$")
# What the eval derives itself (its render task plans where the batch's files go).
EVAL_OWN = {"input_uri", "output_uri"}


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"{name}_dag_module", REPO / "dags" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A deployment that scales serving roles: the DAGs then have every task of the pipeline.
ROLES = '{"decode": {"kind": "StormService", "name": "llm"}}'


@pytest.fixture(scope="module")
def dags() -> Iterator[tuple[Any, Any]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIRFLOW__AIBRIX_SCALING__ROLES", ROLES)
        batch = _load("batch_inference").dag
        evals = [v for k, v in vars(_load("nightly_eval")).items() if k.startswith("nightly_eval__")]
    assert evals, "no nightly eval DAG was built"
    yield batch, evals[0]


def test_a_deployment_without_roles_gets_no_scaling_tasks(monkeypatch) -> None:
    """Three task runs a batch that would do nothing: not in the DAG unless roles are configured."""
    monkeypatch.delenv("AIRFLOW__AIBRIX_SCALING__ROLES", raising=False)
    plain = _load("batch_inference").dag
    assert set(plain.task_dict) == {"validate", "split", "dispatch", "merge", "record_failure"}
    assert plain.task_dict["dispatch"].upstream_task_ids == {"validate", "split"}
    monkeypatch.setenv("AIRFLOW__AIBRIX_SCALING__ROLES", ROLES)
    scaled = _load("batch_inference").dag
    assert {"roles_ready", "autoscale", "scale_down"} < set(scaled.task_dict)


def _fields(task: Any) -> dict[str, Any]:
    source = getattr(task, "partial_kwargs", None)  # a mapped task keeps its arguments there
    return {f: (source[f] if source is not None and f in source else getattr(task, f, None))
            for f in task.template_fields}  # fmt: skip


def test_the_eval_runs_the_same_tasks_with_every_param(dags) -> None:
    from aibrix_operators.operators.pipeline import BATCH_PARAMS, BatchTasks

    batch, evaluation = dags
    for name in BatchTasks._fields:
        ours, theirs = batch.task_dict[name], evaluation.task_dict[f"batch.{name}"]
        assert type(ours) is type(theirs), name
        assert ours.retries == theirs.retries and ours.trigger_rule == theirs.trigger_rule, name
        assert ours.pool == theirs.pool, name
        assert {f"batch.{t}" for t in ours.upstream_task_ids} <= theirs.upstream_task_ids, name
        mine, eval_fields = _fields(ours), _fields(theirs)
        assert set(mine) == set(eval_fields), name
        for field, value in mine.items():
            match = PARAM_TEMPLATE.match(value) if isinstance(value, str) else None
            if match is None or match[1] in EVAL_OWN:
                continue
            param = match[1]
            assert param in BATCH_PARAMS, (name, field, param)
            # The eval passes its own param of that name, or the pipeline's default: never a
            # value of its own making.
            assert eval_fields[field] in (value, BATCH_PARAMS[param].value), (name, field, eval_fields[field])


def test_the_eval_groups_prefixes_like_the_dag(dags) -> None:
    batch, evaluation = dags
    assert _fields(batch.task_dict["validate"])["prefix_grouping"] == "{{ params.prefix_grouping }}"
    assert _fields(evaluation.task_dict["batch.validate"])["prefix_grouping"] == "auto"
    record = evaluation.task_dict["batch.record_failure"]
    assert record.validate_task_id == "batch.validate"
    assert record.step_task_ids == ("batch.split", "batch.dispatch", "batch.merge")


def test_the_pipeline_takes_every_param_and_nothing_else() -> None:
    from airflow.sdk import DAG

    from aibrix_operators.operators.pipeline import add_batch_tasks, param_defaults

    with DAG("pipeline_args_check", schedule=None):
        args = param_defaults()
        args.pop("concurrency")
        with pytest.raises(ValueError, match=r"missing \['concurrency'\]"):
            add_batch_tasks(args, input_uri="in", output_uri="out")
        with pytest.raises(ValueError, match=r"unknown \['concurency'\]"):
            add_batch_tasks({**param_defaults(), "concurency": 1}, input_uri="in", output_uri="out")


def test_every_operator_documents_its_arguments_in_the_providers_style() -> None:
    """``:param name: ... (templated)`` for every template field, as Airflow's providers do."""
    import inspect

    from aibrix_operators.operators.batch import (
        MergeBatchOperator,
        RecordBatchFailureOperator,
        SplitBatchOperator,
        ValidateBatchOperator,
    )
    from aibrix_operators.operators.batch_api import AIBrixBatchOperator
    from aibrix_operators.operators.dispatch import DispatchShardOperator

    for operator in (ValidateBatchOperator, SplitBatchOperator, DispatchShardOperator,
                     MergeBatchOperator, RecordBatchFailureOperator, AIBrixBatchOperator):  # fmt: skip
        doc = inspect.getdoc(operator) or ""
        params = dict(re.findall(r":param (\w+):(.*?)(?=\n:param |\Z)", doc, re.S))
        arguments = set(inspect.signature(operator.__init__).parameters) - {"self", "kwargs"}
        assert set(params) == arguments, (operator.__name__, arguments ^ set(params))
        for field in operator.template_fields:
            assert "(templated)" in params[field], (operator.__name__, field)
