"""Validate, split and merge: thin Airflow operators over ``aibrix_operators.batch.job``."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from aibrix_operators.batch.job import (
    ValidatedBatch,
    finalize_batch,
    record_batch_failure,
    split_batch,
    validate_batch,
    work_prefix,
)
from aibrix_operators.batch.merging import ExactlyOnceViolation
from aibrix_operators.batch.records import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_LINE_BYTES,
    DEFAULT_MAX_REQUESTS,
)
from aibrix_operators.batch.sharding import AIRFLOW_MAX_MAP_LENGTH, ShardSpec
from aibrix_operators.batch.validation import ValidationLimits
from aibrix_operators.hooks.batch_storage import BatchStorageHook

log = logging.getLogger(__name__)


class ValidateBatchOperator(BaseOperator):
    """Validate an OpenAI Batch JSONL file before any inference.

    Returns the validated batch (XCom). An invalid file fails the task without
    retries, with a line-numbered report in the log and in ``batch.json``.
    """

    template_fields: Sequence[str] = (
        "input_uri", "output_uri", "batch_endpoint", "max_requests", "max_file_bytes",
        "max_line_bytes", "completion_window", "metadata", "expected_model", "aws_conn_id",
    )

    def __init__(
        self,
        *,
        input_uri: str,
        output_uri: str,
        batch_endpoint: str | None = None,
        max_requests: int = DEFAULT_MAX_REQUESTS,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
        expected_model: str | None = None,
        aws_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.expected_model = expected_model
        self.input_uri = input_uri
        self.output_uri = output_uri
        self.batch_endpoint = batch_endpoint
        self.max_requests = max_requests
        self.max_file_bytes = max_file_bytes
        self.max_line_bytes = max_line_bytes
        self.completion_window = completion_window
        self.metadata = metadata
        self.aws_conn_id = aws_conn_id

    def execute(self, context: Context) -> dict[str, Any]:
        storage = BatchStorageHook(self.aws_conn_id).storage_for(self.input_uri)
        out_storage = BatchStorageHook(self.aws_conn_id).storage_for(self.output_uri)
        if type(storage) is not type(out_storage):
            raise AirflowFailException(
                f"input {self.input_uri} and output {self.output_uri} must be on the same kind of "
                "storage (both local or both s3://)"
            )
        limits = ValidationLimits(
            max_requests=int(self.max_requests), max_file_bytes=int(self.max_file_bytes),
            max_line_bytes=int(self.max_line_bytes),
        )
        try:
            report, batch = validate_batch(
                storage, self.input_uri, self.output_uri, _endpoint_or_auto(self.batch_endpoint), limits,
                self.completion_window, {str(k): str(v) for k, v in (self.metadata or {}).items()},
                expected_model=self.expected_model or None,
            )
        except ValueError as exc:  # a bad parameter, e.g. completion_window
            raise AirflowFailException(str(exc)) from exc
        if batch is None:
            log.error("%s", report.summary())
            raise AirflowFailException(report.summary())
        log.info("%s", report.summary())
        return batch.as_dict()


def _endpoint_or_auto(value: str | None) -> str | None:
    """``"auto"`` (the DAG form's default) or empty means: take it from the first line."""
    return None if value in (None, "", "auto") else value


class SplitBatchOperator(BaseOperator):
    """Cut the validated file into shards; returns shard descriptors for ``expand``."""

    template_fields: Sequence[str] = (
        "validated", "requests_per_shard", "bytes_per_shard", "max_shards", "aws_conn_id",
    )

    def __init__(
        self,
        *,
        validated: Any,
        requests_per_shard: int = 5_000,
        bytes_per_shard: int = 64 * 1024 * 1024,
        max_shards: int = AIRFLOW_MAX_MAP_LENGTH,
        aws_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.validated = validated
        self.requests_per_shard = requests_per_shard
        self.bytes_per_shard = bytes_per_shard
        self.max_shards = max_shards
        self.aws_conn_id = aws_conn_id

    def execute(self, context: Context) -> list[dict[str, Any]]:
        batch = ValidatedBatch.from_dict(self.validated)
        storage = BatchStorageHook(self.aws_conn_id).storage_for(batch.input_uri)
        work = work_prefix(batch.output_uri, context["run_id"])
        shards = split_batch(
            storage, batch, work, int(self.requests_per_shard), int(self.bytes_per_shard),
            int(self.max_shards),
        )
        log.info("split %d requests into %d shard(s) under %s", batch.total_requests, len(shards), work)
        return [s.as_dict() for s in shards]


class MergeBatchOperator(BaseOperator):
    """Merge shard results into output.jsonl / errors.jsonl / batch.json, in input order."""

    template_fields: Sequence[str] = ("validated", "shards", "outcomes", "aws_conn_id")

    def __init__(
        self,
        *,
        validated: Any,
        shards: Any,
        outcomes: Any,
        aws_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.validated = validated
        self.shards = shards
        self.outcomes = outcomes
        self.aws_conn_id = aws_conn_id

    def execute(self, context: Context) -> dict[str, Any]:
        batch = ValidatedBatch.from_dict(self.validated)
        shards = [ShardSpec.from_dict(s) for s in self.shards]
        # Index by length: iterating a lazy XCom sequence probes one past the end and logs a 404.
        outcomes = [self.outcomes[i] for i in range(len(self.outcomes))] if self.outcomes else []
        storage = BatchStorageHook(self.aws_conn_id).storage_for(batch.output_uri)
        work = work_prefix(batch.output_uri, context["run_id"])
        started = min((o.get("started_at", batch.created_at) for o in outcomes), default=None)
        try:
            summary, obj = finalize_batch(storage, batch, shards, work, in_progress_at=started)
        except ExactlyOnceViolation as exc:
            raise AirflowFailException(f"exactly-once check failed: {exc}") from exc
        wall = max(time.time() - batch.created_at, 1e-9)
        counts = obj.request_counts
        log.info(
            "batch %s %s: %d requests, %d completed, %d failed, %d input + %d output tokens, "
            "%.1f s, %.1f requests/s; output %s",
            obj.id, obj.status, counts["total"], counts["completed"], counts["failed"],
            summary.usage.input_tokens, summary.usage.output_tokens, wall, counts["total"] / wall,
            batch.output_uri,
        )
        result = obj.as_dict()
        result["summary"] = summary.as_dict()
        return result


class RecordBatchFailureOperator(BaseOperator):
    """Runs when a step failed: publishes a failed ``batch.json`` and fails the run.

    Use with ``trigger_rule="one_failed"`` downstream of every step. It fails
    itself on purpose, so the DAG run ends failed while the batch record says why.
    A validation failure has already written its own line-numbered report.
    """

    template_fields: Sequence[str] = ("aws_conn_id",)

    def __init__(
        self, *, validate_task_id: str = "validate", aws_conn_id: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.validate_task_id = validate_task_id
        self.aws_conn_id = aws_conn_id

    def execute(self, context: Context) -> None:
        validated = context["ti"].xcom_pull(task_ids=self.validate_task_id)
        if not validated:
            raise AirflowFailException("the batch failed validation; its report is in batch.json")
        batch = ValidatedBatch.from_dict(validated)
        storage = BatchStorageHook(self.aws_conn_id).storage_for(batch.output_uri)
        message = (
            f"run {context['run_id']} failed after validation; see the failed tasks' logs. "
            "Clearing them resumes from the checkpoints under "
            f"{work_prefix(batch.output_uri, context['run_id'])}"
        )
        record_batch_failure(storage, batch, "batch_run_failed", message)
        raise AirflowFailException(message)
