"""s3_dropzone: a JSONL file landing in the S3 inbox starts a batch_inference run by itself.

wait (deferrable: polls the inbox in the triggerer) → claim (hash, dedupe, snapshot) →
start_batch (one batch_inference run per new file, run id derived from name + content) → record.
Continuous schedule, one run at a time. Settings: [aibrix_dropzone] in the Airflow config
(inbox, outbox, aws_conn_id, dag_conf, ...). Results: <outbox>/<name>/output.jsonl, errors.jsonl,
batch.json. Design: docs/dropzone.md.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import DAG

from aibrix_operators.operators.dropzone import ClaimDropsOperator, DropZoneSensor, RecordClaimsOperator

with DAG(
    dag_id="s3_dropzone",
    description="S3 inbox → batch_inference → S3 outbox",
    # A new run starts as soon as the previous ends; its wait is deferred, so an idle drop zone
    # holds a triggerer slot, no worker slot.
    schedule="@continuous",
    # A start_date in the past: without one the first continuous run's data interval is empty,
    # the next run gets the same logical date, and the scheduler never creates it.
    start_date=datetime(2024, 1, 1, tzinfo=UTC),
    max_active_runs=1,  # claims are made by one run at a time
    catchup=False,
    tags=["aibrix", "batch", "s3"],
    doc_md=__doc__,
    # An S3 fault during claim/record is retried; if it lasts, the run fails and the continuous
    # schedule starts the next one, so the retries also pace a drop zone that cannot write.
    default_args={"retries": 2, "retry_delay": timedelta(seconds=30)},
) as dag:
    wait = DropZoneSensor(task_id="wait", retries=0)  # its own wait already spans the failures
    claim = ClaimDropsOperator(task_id="claim", objects=wait.output)
    start_batch = TriggerDagRunOperator.partial(
        task_id="start_batch",
        trigger_dag_id="batch_inference",
        logical_date=None,
        # The run id is the claim's: a second start of the same (name, content) is skipped.
        skip_when_already_exists=True,
        wait_for_completion=False,
        openlineage_inject_parent_info=False,
    ).expand_kwargs(claim.output)
    record = RecordClaimsOperator(task_id="record", trigger_rule="none_failed")
    claim >> start_batch >> record
