"""``AIBrixBatchOperator``: one batch through an OpenAI-compatible Batch API, as a step of any DAG.

The operator uploads the input, creates the batch and defers to ``BatchApiTrigger`` while it
runs (no worker slot held); when the batch ends it returns the batch's ids, counts and usage
through XCom, or fails the task with a summary of the batch's errors. It speaks only OpenAI's
Batch API (through the official SDK), so the same operator drives this project's API or any
OpenAI-compatible service; the ``aibrix_batch`` connection (``hooks/batch_api.py``) says which.

**A retry never submits twice.** Every batch it creates carries the task instance's key in its
metadata (``airflow_task_key``: a digest of dag, task, run and map index). A later try of the
same task instance — after a lost worker, a retry, a cleared task — first looks for that key
among the batches created since its run started and re-attaches to the batch it finds while
that batch runs or once it has completed, instead of uploading again. A batch that ended
failed, expired or cancelled is not re-attached: clearing such a task is asking for a new batch.
The create also carries an Idempotency-Key (the key and the try number), so a create the
service received twice within one try is one batch where the service honours it (this
project's API does).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from aibrix_operators.client.batch_client import TERMINAL, BatchClient, stop_rules_request
from aibrix_operators.client.errors import StopRulesError
from aibrix_operators.hooks.batch_api import DEFAULT_CONN_ID, BatchApiHook
from aibrix_operators.hooks.batch_storage import UsesBatchStorage
from aibrix_operators.trust.deployment import load_policy
from aibrix_operators.trust.policy import TrustViolation

TASK_KEY = "airflow_task_key"
# How far before its run's start a batch of this task instance may look created: the service's
# clock against the worker's.
CLOCK_SLACK = timedelta(hours=1)
# Re-attaching reads at most this many of the tenant's newest batches.
MAX_SCAN = 2000
MAX_ERRORS_SHOWN = 5
ENDED_UNFINISHED = ("failed", "expired", "cancelled")


class AIBrixBatchOperator(UsesBatchStorage, BaseOperator):
    """Run one OpenAI Batch API batch and wait for it, deferred.

    :param input_file: a local JSONL path the worker reads (one of ``input_file``,
        ``input_uri``, ``input_file_id``). Checked against the deployment's storage allow-list.
        (templated)
    :param input_uri: the JSONL as a local path or ``s3://`` URI, read through
        ``aws_conn_id`` and streamed to the API. Checked against the storage allow-list. (templated)
    :param input_file_id: a file already uploaded with purpose ``batch``. (templated)
    :param endpoint: the batch's endpoint, e.g. ``/v1/chat/completions`` (every line's ``url``).
        (templated)
    :param model: when set, the input's first line must name this model (the service checks
        every line); a mismatch fails the task before anything is uploaded. (templated)
    :param completion_window: the batch's window, e.g. ``24h``. (templated)
    :param metadata: the batch's metadata (at most 15 pairs: the operator adds its key).
        (templated)
    :param stop_rules: the batch's stop rules (``max_error_rate``, ``error_rate_min_sample``,
        ``max_total_tokens``; docs/stop-rules.md), sent as the API's ``stop_rules`` extension: a
        service without it ignores or refuses the field. (templated)
    :param batch_conn_id: the ``aibrix_batch`` connection (base URL and API key). Not templated:
        a run's params cannot point the task at another connection's key.
    :param aws_conn_id: the AWS connection that reads an ``s3://`` ``input_uri``.
    :param deferrable: wait in the triggerer (default) or poll in the worker.
    :param poll_interval_s: the first wait between polls; each next one is 1.5 times longer,
        up to ``max_poll_interval_s``.
    :param max_poll_interval_s: the longest wait between polls.
    :param fail_on_partial: fail the task when the batch completed with failed requests.
    """

    template_fields: Sequence[str] = ("input_file", "input_uri", "input_file_id", "endpoint", "model",
                                      "completion_window", "metadata", "stop_rules")
    template_fields_renderers = {"metadata": "json"}
    ui_color = "#e8f0fe"

    def __init__(
        self,
        *,
        input_file: str | None = None,
        input_uri: str | None = None,
        input_file_id: str | None = None,
        endpoint: str = "/v1/chat/completions",
        model: str | None = None,
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
        stop_rules: dict[str, Any] | None = None,
        batch_conn_id: str = DEFAULT_CONN_ID,
        aws_conn_id: str | None = None,
        deferrable: bool = True,
        poll_interval_s: float = 5.0,
        max_poll_interval_s: float = 60.0,
        fail_on_partial: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if sum(x is not None for x in (input_file, input_uri, input_file_id)) != 1:
            raise ValueError(f"{self.task_id}: give exactly one of input_file, input_uri and input_file_id")
        self.input_file = input_file
        self.input_uri = input_uri
        self.input_file_id = input_file_id
        self.endpoint = endpoint
        self.model = model
        self.completion_window = completion_window
        self.metadata = metadata
        self.stop_rules = stop_rules
        self.batch_conn_id = batch_conn_id
        self.aws_conn_id = aws_conn_id
        self.deferrable = deferrable
        self.poll_interval_s = poll_interval_s
        self.max_poll_interval_s = max_poll_interval_s
        self.fail_on_partial = fail_on_partial
        self.batch_id: str | None = None

    # ------------------------------------------------------------------ submit
    def execute(self, context: Context) -> dict[str, Any]:
        client = BatchApiHook(self.batch_conn_id).get_conn()
        key = task_key(context)
        batch = find_batch(client, key, run_started(context) - CLOCK_SLACK)
        if batch is not None and batch.status in ENDED_UNFINISHED:
            self.log.info("an earlier try's batch %s ended %s: submitting a new one", batch.id, batch.status)
            batch = None
        if batch is not None:
            self.log.info("re-attaching to batch %s (%s), submitted by an earlier try of this task",
                          batch.id, batch.status)
        else:
            batch = self._submit(client, key, f"{key}-try{context['ti'].try_number}")
            self.log.info("submitted batch %s (%s)", batch.id, batch.status)
        self.batch_id = batch.id
        context["ti"].xcom_push(key="batch_id", value=batch.id)
        if batch.status in TERMINAL:
            return self._finish(context, batch.model_dump(mode="json"), client.base_url)
        if self.deferrable:
            from aibrix_operators.triggers.batch_api import BatchApiTrigger

            self.defer(trigger=BatchApiTrigger(batch.id, self.batch_conn_id, self.poll_interval_s,
                                               self.max_poll_interval_s),
                       method_name="execute_complete", timeout=self.execution_timeout)
        done = client.wait(batch.id, poll_s=self.poll_interval_s)
        return self._finish(context, done.model_dump(mode="json"), client.base_url)

    def _submit(self, client: BatchClient, key: str, idempotency_key: str) -> Any:
        metadata = {**(self.metadata or {}), TASK_KEY: key}
        try:
            stop_rules_request(self.stop_rules or None)
        except StopRulesError as exc:  # the trigger's values: a retry would be refused the same
            raise AirflowFailException(f"{self.task_id}: {exc}") from exc
        if len(metadata) > 16:
            raise AirflowFailException(f"{self.task_id}: metadata has {len(metadata) - 1} pairs; "
                                       "at most 15 (OpenAI's limit of 16, one is the operator's)")
        if self.input_file_id is not None:
            return client.create_batch(input_file_id=self.input_file_id, endpoint=self.endpoint,
                                       completion_window=self.completion_window, metadata=metadata,
                                       idempotency_key=idempotency_key, stop_rules=self.stop_rules or None)
        uri = self.input_uri if self.input_uri is not None else os.fspath(self.input_file)  # type: ignore[arg-type]
        param = "input_uri" if self.input_uri is not None else "input_file"
        try:
            load_policy().check_storage(uri, param)
        except TrustViolation as exc:  # the trigger's doing: a retry would be refused the same
            raise AirflowFailException(str(exc)) from exc
        storage = self.hook.storage_for(uri)
        if self.model is not None:
            with storage.open_read(uri) as fh:
                check_first_model(fh.readline(), self.model, param)
        with storage.open_read(uri) as fh:
            uploaded = client.openai.files.create(file=(os.path.basename(uri) or "input.jsonl", fh),
                                                  purpose="batch")
        return client.create_batch(input_file_id=uploaded.id, endpoint=self.endpoint,
                                   completion_window=self.completion_window, metadata=metadata,
                                   idempotency_key=idempotency_key, stop_rules=self.stop_rules or None)

    # ------------------------------------------------------------------ finish
    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        status = event.get("status")
        if status == "error":
            # Retried like any task failure; the next try re-attaches to the batch.
            raise AirflowException(event.get("message", "the Batch API trigger failed"))
        if status == "timeout":
            raise AirflowException(f"batch {event.get('batch_id')} still running at the task's timeout")
        base_url = BatchApiHook(self.batch_conn_id).get_conn().base_url
        return self._finish(context, event["batch"], base_url)

    def _finish(self, context: Context, batch: dict[str, Any], base_url: str) -> dict[str, Any]:
        result = batch_result(batch, base_url)
        counts = result["request_counts"]
        if batch["status"] != "completed":
            raise AirflowFailException(failure_summary(batch))
        if self.fail_on_partial and counts.get("failed"):
            raise AirflowFailException(f"batch {batch['id']} completed with {counts['failed']} of "
                                       f"{counts['total']} requests failed (fail_on_partial); "
                                       f"their lines: {result['error_uri']}")
        for outlet in self.outlets or ():
            if getattr(outlet, "uri", None) is not None:  # an Asset: its event carries the batch
                context["outlet_events"][outlet].extra = result
        self.log.info("batch %s completed: %s", batch["id"], json.dumps(counts))
        return result

    def on_kill(self) -> None:
        """The task was stopped while it polled in the worker: cancel its batch (a deferred
        task's batch runs on; clearing the task re-attaches to it)."""
        if self.batch_id is not None:
            BatchApiHook(self.batch_conn_id).get_conn().cancel(self.batch_id)
            self.log.info("cancelled batch %s", self.batch_id)


def task_key(context: Context) -> str:
    """The same for every try of one task instance, different for every other."""
    ti = context["ti"]
    ident = json.dumps([ti.dag_id, ti.task_id, ti.run_id, ti.map_index])
    return "airflow-" + hashlib.sha256(ident.encode()).hexdigest()[:32]


def run_started(context: Context) -> datetime:
    dag_run = context["dag_run"]
    return dag_run.start_date or dag_run.run_after


def find_batch(client: BatchClient, key: str, since: datetime) -> Any | None:
    """The newest batch carrying ``key`` among those created since ``since``; None if none."""
    floor = since.timestamp()
    for n, batch in enumerate(client.list(limit=100, all=True)):
        if batch.created_at < floor or n >= MAX_SCAN:
            return None
        if (batch.metadata or {}).get(TASK_KEY) == key:
            return batch
    return None


def check_first_model(line: bytes, model: str, param: str) -> None:
    try:
        named = json.loads(line)["body"]["model"]
    except (ValueError, KeyError, TypeError):
        raise AirflowFailException(f"{param}: line 1 is not a batch request with body.model; each line is "
                                   '{"custom_id", "method", "url", "body": {"model", …}}') from None
    if named != model:
        raise AirflowFailException(f"{param}: line 1 asks for model {named!r}, the task for {model!r}; "
                                   "fix the file or the task's model")


def batch_result(batch: dict[str, Any], base_url: str) -> dict[str, Any]:
    """What the task returns (XCom) and its Asset events carry."""
    def content(file_id: str | None) -> str | None:
        return f"{base_url}/files/{file_id}/content" if file_id else None

    return {
        "batch_id": batch["id"], "status": batch["status"],
        "output_file_id": batch.get("output_file_id"), "error_file_id": batch.get("error_file_id"),
        "output_uri": content(batch.get("output_file_id")), "error_uri": content(batch.get("error_file_id")),
        "request_counts": batch.get("request_counts") or {}, "usage": batch.get("usage"),
        "metadata": batch.get("metadata") or {},
    }


def failure_summary(batch: dict[str, Any]) -> str:
    counts = batch.get("request_counts") or {}
    errors = ((batch.get("errors") or {}).get("data")) or []
    shown = "; ".join(
        f"{e.get('code')}" + (f" (line {e['line']})" if e.get("line") else "") + f": {e.get('message')}"
        for e in errors[:MAX_ERRORS_SHOWN])
    more = f" and {len(errors) - MAX_ERRORS_SHOWN} more" if len(errors) > MAX_ERRORS_SHOWN else ""
    return (f"batch {batch['id']} ended {batch['status']}: {counts.get('completed', 0)} of "
            f"{counts.get('total', 0)} requests completed, {counts.get('failed', 0)} failed"
            + (f"; errors: {shown}{more}" if shown else "")
            + (f"; error lines in file {batch['error_file_id']}" if batch.get("error_file_id") else ""))
