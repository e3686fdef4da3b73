"""A user's DAG whose ``AIBrixBatchOperator`` waits in its worker (``deferrable=False``): the
test that loses that worker mid-batch (tests/integration/test_batch_api.py) needs the task
running in a worker process, not deferred to the triggerer. Retried once, at once."""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DAG, Param

from aibrix_operators.operators.batch_api import AIBrixBatchOperator

with DAG(
    "batch_operator_in_worker",
    schedule=None,
    catchup=False,
    params={"input_file": Param(type="string"), "model": Param(type="string")},
):
    AIBrixBatchOperator(
        task_id="answer",
        input_file="{{ params.input_file }}",
        model="{{ params.model }}",
        deferrable=False,
        retries=1,
        retry_delay=timedelta(seconds=0),
        poll_interval_s=0.5,
    )
