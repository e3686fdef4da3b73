"""Validate, split and merge: thin Airflow operators over ``aibrix_operators.batch.job``."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from aibrix_operators.batch.admission import Admission, endpoint_label
from aibrix_operators.batch.deadline import submitted_at
from aibrix_operators.batch.error_codes import BatchFailure, ValidationCode
from aibrix_operators.batch.failures import (
    FailureRecord,
    error_list,
    failed_batch,
    one_line,
    publish_failure,
)
from aibrix_operators.batch.job import (
    ValidatedBatch,
    finalize_batch,
    prefix_order_uri,
    record_batch_failure,
    split_batch,
    validate_batch,
    work_prefix,
)
from aibrix_operators.batch.job_pool import JobPool, JobPoolError
from aibrix_operators.batch.lifecycle import BatchStatus
from aibrix_operators.batch.merging import ExactlyOnceViolation
from aibrix_operators.batch.records import (
    DEFAULT_COMPLETION_WINDOW,
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_LINE_BYTES,
    DEFAULT_MAX_REQUESTS,
    new_batch_id,
)
from aibrix_operators.batch.sharding import AIRFLOW_MAX_MAP_LENGTH, ShardSpec
from aibrix_operators.batch.validation import ValidationLimits
from aibrix_operators.hooks.batch_storage import BatchStorageHook, UsesBatchStorage
from aibrix_operators.lora.registry import AdapterRegistryError
from aibrix_operators.operators.batch_end import engine_time, learn_and_leave, record_expiry
from aibrix_operators.operators.batch_metrics import batch_published
from aibrix_operators.operators.dry_run import end_dry_run, prompt_counter
from aibrix_operators.operators.memory import release_freed_memory
from aibrix_operators.operators.step_errors import collect_step_errors, records_step_error
from aibrix_operators.settings.admission import load_admission_mode
from aibrix_operators.settings.completion_window import load_min_completion_window_s
from aibrix_operators.settings.job_pool import load_job_pool_limits
from aibrix_operators.settings.locations import LocationNotSet, configured, state_aws_conn_id, state_root
from aibrix_operators.settings.lora import load_adapter_registry
from aibrix_operators.settings.prices import load_prices
from aibrix_operators.settings.stop_rules import load_max_batch_tokens
from aibrix_operators.storage import Storage
from aibrix_operators.trust.deployment import load_policy, resolve_inference
from aibrix_operators.trust.policy import TrustPolicy, TrustViolation, describe

log = logging.getLogger(__name__)
# XCom key under which validate says where its failure was recorded (or why it was not).
FAILURE_RECORD_KEY = "failure_record"


class ValidateBatchOperator(UsesBatchStorage, BaseOperator):
    """Check the trigger against the allow-list, then validate the batch file before any inference.

    Returns the validated batch (XCom). Any failure — a trigger the allow-list
    refuses, a bad parameter, an input that cannot be read, invalid content —
    fails the task without retries, with a specific error in the log and in a
    failed ``batch.json`` at the output (when the output may and can be written;
    otherwise the log says why not). The outcome is also pushed as XCom
    ``failure_record`` for ``RecordBatchFailureOperator``.

    :param input_uri: The OpenAI Batch JSONL file: a local path or ``s3://bucket/key``. (templated)
    :param output_uri: Where the batch's outputs go: a local directory or ``s3://`` prefix. (templated)
    :param batch_endpoint: The batch's endpoint (``/v1/chat/completions``, ...); ``auto`` or empty:
        the first line's ``url``. Every line must match it. (templated)
    :param max_requests: Lines allowed at most. (templated)
    :param max_file_bytes: Size of the file allowed at most. (templated)
    :param max_line_bytes: Size of one line allowed at most. (templated)
    :param completion_window: Deadline from submission, e.g. ``24h``. (templated)
    :param metadata: String pairs kept in ``batch.json``. (templated)
    :param expected_model: ``body.model`` every line must name; empty accepts the file's. (templated)
    :param aws_conn_id: Airflow connection for ``s3://`` URIs; empty: boto3's defaults. (templated)
    :param endpoint: Base URL of the inference server, checked against the allow-list. (templated)
    :param inference_conn_id: Airflow connection of the inference server (host and key). (templated)
    :param prefix_grouping: ``auto`` groups requests sharing a prompt prefix into shards; ``off``
        keeps input order. (templated)
    :param job_pool: The batch's job-pool values (``batch/job_pool.py`` keys), checked against the
        deployment's ``pool_*`` limits before anything is read. (templated)
    :param stop_rules: The batch's stop rules (``batch/stop_rules.py``: ``max_error_rate``,
        ``error_rate_min_sample``, ``max_total_tokens``), checked against the deployment's
        ``max_batch_tokens``; None: none. (templated)
    :param output_expires_after: OpenAI's ``{"anchor": "created_at", "seconds": N}``: the output
        and error files are deleted N seconds after merge writes them (batch/output_expiry.py);
        None: kept. (templated)
    :param dry_run: Validate and estimate only (operators/dry_run.py): the estimate goes to
        ``<output_uri>/estimate.json`` and the task ends skipped, with every later step. (templated)
    """

    template_fields: Sequence[str] = (
        "input_uri", "output_uri", "batch_endpoint", "max_requests", "max_file_bytes",
        "max_line_bytes", "completion_window", "metadata", "expected_model", "aws_conn_id",
        "endpoint", "inference_conn_id", "prefix_grouping", "job_pool", "stop_rules", "output_expires_after",
        "dry_run",
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
        completion_window: str = DEFAULT_COMPLETION_WINDOW,
        metadata: dict[str, str] | None = None,
        expected_model: str | None = None,
        aws_conn_id: str | None = None,
        endpoint: str | None = None,
        inference_conn_id: str | None = None,
        prefix_grouping: str = "auto",
        job_pool: dict[str, Any] | None = None,
        stop_rules: dict[str, Any] | None = None,
        output_expires_after: dict[str, Any] | None = None,
        dry_run: bool | str = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.dry_run = dry_run
        self.job_pool = job_pool
        self.stop_rules = stop_rules
        self.output_expires_after = output_expires_after
        self.expected_model = expected_model
        # "auto": group requests with shared prefixes into shards (batch/prefixes.py); "off".
        self.prefix_grouping = prefix_grouping
        self.input_uri = input_uri
        self.output_uri = output_uri
        self.batch_endpoint = batch_endpoint
        self.max_requests = max_requests
        self.max_file_bytes = max_file_bytes
        self.max_line_bytes = max_line_bytes
        self.completion_window = completion_window
        self.metadata = metadata
        self.aws_conn_id = aws_conn_id
        # Checked here (before anything is read) so a refused trigger fails at once.
        self.endpoint = endpoint
        self.inference_conn_id = inference_conn_id

    def execute(self, context: Context) -> dict[str, Any]:
        batch_id = new_batch_id()
        metadata = {str(k): str(v) for k, v in (self.metadata or {}).items()}
        policy = load_policy()
        # The output gets a record only if the trigger may write there with that connection.
        output_refusal = _refusal(policy, self.output_uri, self.aws_conn_id)
        try:
            policy.check_trigger(
                input_uri=self.input_uri, output_uri=self.output_uri, aws_conn_id=self.aws_conn_id,
                endpoint=self.endpoint, inference_conn_id=self.inference_conn_id,
            )
            resolve_inference(policy, self.endpoint, self.inference_conn_id)
            pool = JobPool.from_mapping({k: v for k, v in (self.job_pool or {}).items()
                                         if v is not None and v != ""})
            pool.check(load_job_pool_limits())
        except JobPoolError as exc:
            self._fail(context, batch_id, metadata, BatchFailure.INVALID_JOB_POOL, str(exc), output_refusal)
        except TrustViolation as exc:
            for line in describe(policy):
                log.info("%s", line)
            self._fail(context, batch_id, metadata, BatchFailure.REFUSED_BY_POLICY, str(exc), output_refusal)
        try:
            storage = self.hook.storage_for(self.input_uri)
            out_storage = self.hook.storage_for(self.output_uri)
        except Exception as exc:  # noqa: BLE001 - e.g. an unknown connection or URI scheme
            self._fail(context, batch_id, metadata, BatchFailure.INVALID_STORAGE,
                       f"{type(exc).__name__}: {exc}", "the output's storage could not be opened")
        if type(storage) is not type(out_storage):
            self._fail(context, batch_id, metadata, BatchFailure.INVALID_OUTPUT_URI,
                       f"input {self.input_uri} and output {self.output_uri} must be on the same kind "
                       "of storage (both local or both s3://)", None, out_storage)
        if self.output_expires_after:
            try:
                state_root()
            except LocationNotSet as exc:
                self._fail(context, batch_id, metadata, ValidationCode.INVALID_OUTPUT_EXPIRES_AFTER,
                           f"this deployment deletes no outputs: {exc}", output_refusal, out_storage)
        try:
            adapters = load_adapter_registry()
        except AdapterRegistryError as exc:
            self._fail(context, batch_id, metadata, BatchFailure.INVALID_ADAPTER_REGISTRY, str(exc),
                       output_refusal, out_storage)
        limits = ValidationLimits(
            max_requests=int(self.max_requests), max_file_bytes=int(self.max_file_bytes),
            max_line_bytes=int(self.max_line_bytes),
        )
        # A dry run counts input tokens with the model's tokenizer, where the deployment names one.
        counter = prompt_counter(adapters.bases()) if self._is_dry_run() else None
        report, batch = validate_batch(
            storage, self.input_uri, self.output_uri, _endpoint_or_auto(self.batch_endpoint), limits,
            str(self.completion_window), metadata, batch_id=batch_id,
            expected_model=self.expected_model or None, output_storage=out_storage,
            prefix_grouping=str(self.prefix_grouping or "auto"),
            prefix_order_uri=prefix_order_uri(work_prefix(self.output_uri, context["run_id"])),
            adapters=adapters.bases(), min_window_s=load_min_completion_window_s(),
            submitted_at=_submitted_at(context), stop_rules=self.stop_rules or None,
            max_batch_tokens=load_max_batch_tokens(), output_expires_after=self.output_expires_after or None,
            admission=self._admission(), dry_run=self._is_dry_run(), count_tokens=counter,
        )
        release_freed_memory()  # the pass's arrays, before the run's next tasks in this worker
        if batch is None:
            record: FailureRecord = report.record
            context["ti"].xcom_push(key=FAILURE_RECORD_KEY, value=record.describe())
            batch_published(batch_id, phase=BatchStatus.FAILED, created_at=time.time())
            log.error("%s", report.summary())
            log.error("%s", record.describe())
            raise AirflowFailException(f"{report.summary()}\n{record.describe()}")
        log.info("%s", report.summary())
        log.info("prefix grouping %s: %d request(s) share a prefix, %d shared prefix group(s)%s",
                 self.prefix_grouping, batch.prefix_shared_requests, batch.prefix_groups,
                 "; shards will hold whole groups" if batch.prefix_order_uri else "; input order kept")
        if self._is_dry_run():
            assert counter is not None
            end_dry_run(context, report, batch, endpoint_label(self.endpoint, self.inference_conn_id),
                        out_storage, counter.basis(report.model))
        batch_published(batch.batch_id, phase=BatchStatus.VALIDATING, requests=batch.total_requests,
                        created_at=batch.created_at, deadline=batch.expires_at)
        return batch.as_dict()

    def _is_dry_run(self) -> bool:
        # A rendered template is a string unless the DAG renders native objects.
        return self.dry_run is True or str(self.dry_run).strip().lower() == "true"

    def _admission(self) -> Admission | None:
        """Where this batch is judged (batch/admission.py); None on a deployment without a state root."""
        root = configured("state_root")
        if root is None:
            return None
        return Admission(BatchStorageHook(state_aws_conn_id()).storage_for(root), root.rstrip("/"),
                         endpoint_label(self.endpoint, self.inference_conn_id), load_admission_mode())

    def _fail(
        self, context: Context, batch_id: str, metadata: dict[str, str], code: str, message: str,
        output_refusal: str | None, out_storage: Storage | None = None,
    ) -> NoReturn:
        """Record a failure found before validation could start, then fail the task."""
        message = one_line(message)
        if output_refusal is not None:
            record = FailureRecord(None, False, output_refusal)
        else:
            obj = failed_batch(
                batch_id=batch_id, input_uri=self.input_uri, errors=error_list(code, message),
                completion_window=str(self.completion_window), metadata=metadata,
                created_at=_submitted_at(context),
            )
            try:
                if out_storage is None:
                    out_storage = self.hook.storage_for(self.output_uri)
                record = publish_failure(out_storage, self.output_uri, obj)
            except Exception as exc:  # noqa: BLE001 - the record is best effort; the log says why
                record = FailureRecord(self.output_uri, False, one_line(f"{type(exc).__name__}: {exc}"))
        context["ti"].xcom_push(key=FAILURE_RECORD_KEY, value=record.describe())
        batch_published(batch_id, phase=BatchStatus.FAILED, created_at=time.time())
        log.error("batch %s failed: [%s] %s", batch_id, code, message)
        log.error("%s", record.describe())
        raise AirflowFailException(f"[{code}] {message}\n{record.describe()}") from None


def _submitted_at(context: Context) -> int:
    """The batch's submission instant, its window's start: the run's ``run_after`` (batch/deadline.py)."""
    dag_run = context.get("dag_run")
    return submitted_at(getattr(dag_run, "run_after", None))


def _refusal(policy: TrustPolicy, output_uri: str, aws_conn_id: str | None) -> str | None:
    """Why nothing may be written at ``output_uri``, or None if a record may go there."""
    try:
        policy.check_storage(output_uri, "output_uri")
        policy.check_aws_conn(aws_conn_id)
    except TrustViolation as exc:
        return f"the output is not a place this trigger may write to ({exc})"
    return None


def _endpoint_or_auto(value: str | None) -> str | None:
    """``"auto"`` (the DAG form's default) or empty means: take it from the first line."""
    return None if value in (None, "", "auto") else value


class SplitBatchOperator(UsesBatchStorage, BaseOperator):
    """Cut the validated file into shards; returns shard descriptors for ``expand``.

    :param validated: The validate task's output (an XComArg). (templated)
    :param requests_per_shard: Requests per shard at most. (templated)
    :param bytes_per_shard: Bytes per shard at most. (templated)
    :param max_shards: Shards at most (Airflow's ``max_map_length``); shards grow to fit. (templated)
    :param aws_conn_id: Airflow connection for ``s3://`` URIs. (templated)
    """

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

    @records_step_error("split")
    def execute(self, context: Context) -> list[dict[str, Any]]:
        batch = ValidatedBatch.from_dict(self.validated)
        storage = self.hook.storage_for(batch.input_uri)
        work = work_prefix(batch.output_uri, context["run_id"])
        shards = split_batch(
            storage, batch, work, int(self.requests_per_shard), int(self.bytes_per_shard),
            int(self.max_shards),
        )
        log.info("split %d requests into %d shard(s) under %s", batch.total_requests, len(shards), work)
        batch_published(batch.batch_id, phase=BatchStatus.IN_PROGRESS, shards=len(shards), shards_done=0)
        return [s.as_dict() for s in shards]


class MergeBatchOperator(UsesBatchStorage, BaseOperator):
    """Merge shard results into output.jsonl / errors.jsonl / batch.json, in input order.

    :param validated: The validate task's output. (templated)
    :param shards: The split task's output (the shard descriptors). (templated)
    :param outcomes: The dispatch tasks' outputs, one per shard. (templated)
    :param aws_conn_id: Airflow connection for ``s3://`` URIs. (templated)
    """

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

    @records_step_error("merge")
    def execute(self, context: Context) -> dict[str, Any]:
        batch = ValidatedBatch.from_dict(self.validated)
        shards = [ShardSpec.from_dict(s) for s in self.shards]
        # Index by length: iterating a lazy XCom sequence probes one past the end and logs a 404.
        outcomes = [self.outcomes[i] for i in range(len(self.outcomes))] if self.outcomes else []
        storage = self.hook.storage_for(batch.output_uri)
        work = work_prefix(batch.output_uri, context["run_id"])
        started = min((o.get("started_at", batch.created_at) for o in outcomes), default=None)
        batch_published(batch.batch_id, phase=BatchStatus.FINALIZING, shards_done=len(outcomes))
        try:
            summary, obj = finalize_batch(storage, batch, shards, work, in_progress_at=started,
                                          prices=load_prices(), engine_s=engine_time(outcomes))
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
        if batch.admission_key is not None:
            learn_and_leave(batch, summary.usage, summary.completed,
                             engine_time(outcomes) or (time.time() - started if started else None))
        if obj.aibrix_output_expires_at is not None:
            record_expiry(batch, obj.aibrix_output_expires_at, self.aws_conn_id or None)
        batch_published(batch.batch_id, phase=obj.status, completed=counts["completed"],
                        failed=counts["failed"], shards_done=len(shards))
        result = obj.as_dict()
        result["summary"] = summary.as_dict()
        for outlet in self.outlets or ():
            if getattr(outlet, "uri", None) is not None:  # an Asset: its event carries the batch
                context["outlet_events"][outlet].extra = asset_extra(result, batch)
        return result


def asset_extra(result: dict[str, Any], batch: ValidatedBatch) -> dict[str, Any]:
    """What a batch's Asset event tells the DAGs scheduled on it (docs/operator.md#assets)."""
    return {"batch_id": result["id"], "status": result["status"], "model": batch.model,
            "request_counts": result["request_counts"], "usage": result.get("usage"),
            "output_uri": batch.output_uri, "metadata": batch.metadata}


class RecordBatchFailureOperator(UsesBatchStorage, BaseOperator):
    """Runs when a step failed: makes sure a failed ``batch.json`` exists and fails the run.

    Use with ``trigger_rule="one_failed"`` downstream of every step. It fails
    itself on purpose, so the DAG run ends failed while the batch record says why.
    A failure in validation has already been recorded by the validate task (its
    XCom ``failure_record`` says where); if validate died without recording one,
    this task writes a generic record itself, if the output is on the allow-list.

    :param validate_task_id: The validate task's id (prefixed inside a TaskGroup).
    :param step_task_ids: The ids of the steps after validation whose errors it publishes.
    :param aws_conn_id: Airflow connection for ``s3://`` URIs. (templated)
    :param output_uri: The batch's output location. (templated)
    :param input_uri: The batch file, named in a generic failure record. (templated)
    """

    template_fields: Sequence[str] = ("aws_conn_id", "output_uri", "input_uri")

    def __init__(
        self,
        *,
        validate_task_id: str = "validate",
        step_task_ids: Sequence[str] = ("split", "dispatch", "merge"),
        aws_conn_id: str | None = None,
        output_uri: str | None = None,
        input_uri: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.validate_task_id = validate_task_id
        self.step_task_ids = tuple(step_task_ids)
        self.aws_conn_id = aws_conn_id
        self.output_uri = output_uri
        self.input_uri = input_uri

    def execute(self, context: Context) -> None:
        ti = context["ti"]
        validated = ti.xcom_pull(task_ids=self.validate_task_id)
        if not validated:
            recorded = ti.xcom_pull(task_ids=self.validate_task_id, key=FAILURE_RECORD_KEY)
            if recorded:
                raise AirflowFailException(f"the batch failed in validation; {recorded}")
            raise AirflowFailException(self._record_without_validation(context))
        batch = ValidatedBatch.from_dict(validated)
        storage = self.hook.storage_for(batch.output_uri)
        message = (
            f"run {context['run_id']} failed after validation; see the failed tasks' logs. "
            "Clearing them resumes from the checkpoints under "
            f"{work_prefix(batch.output_uri, context['run_id'])}"
        )
        # The steps' own errors (model_not_served, storage_error, ...) when they left them.
        if batch.admission_key is not None:
            learn_and_leave(batch, None, 0, None)
        errors = collect_step_errors(ti, self.step_task_ids)
        if not errors:
            record = record_batch_failure(storage, batch, BatchFailure.BATCH_RUN_FAILED, message)
        else:
            obj = failed_batch(
                batch_id=batch.batch_id, input_uri=batch.input_uri,
                errors={"object": "list", "data": errors, "total": len(errors)},
                endpoint=batch.endpoint, completion_window=batch.completion_window,
                created_at=batch.created_at, expires_at=batch.expires_at,
                total_requests=batch.total_requests, metadata=batch.metadata,
            )
            record = publish_failure(storage, batch.output_uri, obj)
            for error in errors:
                log.error("[%s] %s", error["code"], error["message"])
        log.error("%s", record.describe())
        batch_published(batch.batch_id, phase=BatchStatus.FAILED)
        raise AirflowFailException(f"{message}\n{record.describe()}")

    def _record_without_validation(self, context: Context) -> str:
        message = (
            f"the validate task of run {context['run_id']} failed before it could record why "
            "(see its log)"
        )
        if not self.output_uri:
            return f"{message}; no output_uri to record it in"
        refusal = _refusal(load_policy(), self.output_uri, self.aws_conn_id)
        if refusal is not None:
            record = FailureRecord(None, False, refusal)
        else:
            obj = failed_batch(batch_id=new_batch_id(), input_uri=self.input_uri or "",
                               errors=error_list(BatchFailure.BATCH_RUN_FAILED, message))
            storage = self.hook.storage_for(self.output_uri)
            record = publish_failure(storage, self.output_uri, obj)
        log.error("%s", record.describe())
        return f"{message}; {record.describe()}"
