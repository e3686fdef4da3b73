"""``BatchWebhookNotifier``: a batch's end, POSTed as JSON to the deployment's webhook.

The pipeline attaches it to the step that ends a batch: merge's success (the batch completed,
expired or was cancelled: its ``batch.json`` status) and record_failure's failure (the batch
failed). Where the message goes is the deployment's: ``[aibrix_batch] notify_webhook_url`` (an
``http(s)://`` URL), with ``notify_webhook_token`` sent as a bearer token when set; no run's params
can point it elsewhere. Unset, nothing is sent. A webhook that fails is logged, never the task's
failure: the batch's outcome is already written.

The message::

    {"batch_id", "status", "request_counts", "usage", "output_uri", "error": null | "…",
     "errors": [the batch's first five errors], "dag_id", "run_id"}
"""

from __future__ import annotations

import json
import logging
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from airflow.sdk import BaseNotifier

from aibrix_operators import config_sections
from aibrix_operators.batch.error_codes import CodedFailure
from aibrix_operators.batch.lifecycle import Step
from aibrix_operators.storage import join_uri

log = logging.getLogger(__name__)
MAX_ERROR_CHARS = 2000
MAX_ERRORS = 5  # of the batch's errors (code, line, message): the rest are in batch.json


class BatchWebhookNotifier(BaseNotifier):
    """:param validate_task_id: the batch's validate task (its XCom names the batch).
    :param timeout_s: the POST's timeout."""

    def __init__(self, validate_task_id: str = Step.VALIDATE.value, timeout_s: float = 10.0) -> None:
        super().__init__()
        self.validate_task_id = validate_task_id
        self.timeout_s = timeout_s

    def notify(self, context: Any) -> None:
        url, token = webhook_settings()
        if not url:
            return
        message = batch_message(context, self.validate_task_id)
        request = urllib.request.Request(url, data=json.dumps(message).encode(), method="POST",
                                         headers={"Content-Type": "application/json",
                                                  **({"Authorization": f"Bearer {token}"} if token else {})})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                log.info("batch %s: notified the webhook (HTTP %s)", message["batch_id"], answer.status)
        except OSError as exc:  # URLError, HTTPError, timeouts: the batch's outcome stands
            log.warning("batch %s: the webhook was not notified: %s", message["batch_id"], exc)


def webhook_settings() -> tuple[str, str]:
    from airflow.sdk import conf

    url = (conf.get(config_sections.BATCH, "notify_webhook_url", fallback="") or "").strip()
    token = (conf.get(config_sections.BATCH, "notify_webhook_token", fallback="") or "").strip()
    if url and urlsplit(url).scheme not in ("http", "https"):
        raise ValueError(f"[{config_sections.BATCH}] notify_webhook_url must be an http(s) URL, not {url!r}")
    return url, token


def batch_message(context: Any, validate_task_id: str) -> dict[str, Any]:
    """What the webhook is told: the batch object the ending task returned (merge), else the
    failed ``batch.json`` the batch's failure published (record_failure, or validate itself)."""
    ti, task = context["ti"], context["task"]
    validated = ti.xcom_pull(task_ids=validate_task_id) or {}
    exception = context.get("exception")
    output_uri = validated.get("output_uri") or getattr(task, "output_uri", None) or None
    batch = ti.xcom_pull(task_ids=ti.task_id) if exception is None else published_batch(task, output_uri)
    batch = batch or {}
    return {
        "batch_id": batch.get("id") or validated.get("batch_id"),
        "status": batch.get("status") or "failed",
        "request_counts": batch.get("request_counts")
        or {"total": validated.get("total_requests", 0), "completed": 0, "failed": 0},
        "usage": batch.get("usage"),
        "output_uri": output_uri,
        "error": None if exception is None else str(exception)[:MAX_ERROR_CHARS],
        "errors": ((batch.get("errors") or {}).get("data") or [])[:MAX_ERRORS],
        "dag_id": ti.dag_id,
        "run_id": ti.run_id,
    }


def published_batch(task: Any, output_uri: str | None) -> dict[str, Any] | None:
    """The batch.json at ``output_uri``, read with the task's storage; None if there is none."""
    if not output_uri or not hasattr(task, "hook"):
        return None
    try:
        return json.loads(task.hook.storage_for(output_uri).read_bytes(join_uri(output_uri, "batch.json")))
    except (OSError, ValueError, CodedFailure) as exc:  # the failure's record could not be read
        log.warning("no batch.json to notify from at %s: %s", output_uri, exc)
        return None
