"""A small batch through the DAG's real operators, in this process (no scheduler): validate →
split → dispatch (local mode) × shards → merge, each ``execute`` called with the context keys
these operators read. The batch gauges they push are what the tests look at."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from aibrix_operators.operators.batch import MergeBatchOperator, SplitBatchOperator, ValidateBatchOperator
from aibrix_operators.operators.dispatch import DispatchShardOperator
from aibrix_operators.trust.policy import DEFAULT_CHAIN


class TaskInstance:
    """The parts of Airflow's RuntimeTaskInstance the batch operators use."""

    def __init__(self, task_id: str, succeeded: dict[str, int]) -> None:
        self.dag_id, self.task_id, self.run_id = "batch_inference", task_id, "manual__metrics"
        self.try_number = 1
        self.xcom: dict[str, Any] = {}
        self._succeeded = succeeded

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcom[key] = json.loads(json.dumps(value))

    def get_ti_count(self, *, dag_id: str, task_ids: list[str], run_ids: list[str], states: list[str]) -> int:
        assert states == ["success"] and run_ids == [self.run_id]
        return sum(self._succeeded.get(t, 0) for t in task_ids)


def allow(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, endpoint: str) -> None:
    """The deployment's allow-list for this test: its files and the fault server only."""
    monkeypatch.setenv("AIRFLOW__AIBRIX_BATCH__ALLOWED_STORAGE", str(tmp_path))
    monkeypatch.setenv("AIRFLOW__AIBRIX_BATCH__ALLOWED_ENDPOINTS", endpoint)
    monkeypatch.setenv("AIRFLOW__AIBRIX_BATCH__ALLOWED_AWS_CONN_IDS", DEFAULT_CHAIN)


def run_batch(tmp_path: Path, endpoint: str, records: list[dict], per_shard: int) -> dict[str, Any]:
    """The merged batch object (batch.json plus ``summary``)."""
    src = tmp_path / "input.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    succeeded: dict[str, int] = {}

    def ctx(task_id: str) -> dict[str, Any]:
        return {"ti": TaskInstance(task_id, succeeded), "run_id": "manual__metrics"}

    validated = ValidateBatchOperator(task_id="validate", input_uri=str(src), output_uri=str(out),
                                      endpoint=endpoint).execute(ctx("validate"))
    shards = SplitBatchOperator(task_id="split", validated=validated,
                                requests_per_shard=per_shard).execute(ctx("split"))
    outcomes = []
    for shard in shards:
        op = DispatchShardOperator(task_id="dispatch", shard=shard, validated=validated, endpoint=endpoint,
                                   concurrency=4, endpoint_wait_s=5)
        outcomes.append(op.execute(ctx("dispatch")))
        succeeded["dispatch"] = succeeded.get("dispatch", 0) + 1
    return MergeBatchOperator(task_id="merge", validated=validated, shards=shards,
                              outcomes=outcomes).execute(ctx("merge"))
