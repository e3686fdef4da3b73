"""aibrix_output_cleanup: every hour, delete the batch outputs whose output_expires_after has come.

Only batches that asked for it (OpenAI's ``output_expires_after``, the Batch API's field or the
batch_inference param) have outputs here; the rest are kept. docs/output-expiry.md.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG

from aibrix_operators.operators.output_cleanup import SweepExpiredOutputsOperator

with DAG(
    dag_id="aibrix_output_cleanup",
    description="Delete batch outputs past their output_expires_after",
    schedule="@hourly",
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["aibrix", "batch"],
):
    SweepExpiredOutputsOperator(task_id="sweep_expired_outputs")
