"""A run's snapshot → OpenAI's Batch object (pure; the Airflow adapter gathers the inputs).

The status comes from ``batch/lifecycle.py``; this module shapes the object a client sees.
"""

from __future__ import annotations

import math
import time
from typing import Any

from aibrix_operators.batch.cost import Prices, cost_line
from aibrix_operators.batch.deadline import deadline
from aibrix_operators.batch.error_codes import BatchFailure
from aibrix_operators.batch.lifecycle import (
    ENDED_WITH_OUTPUT,
    TERMINAL,
    BatchStatus,
    RunSnapshot,
    Step,
    TaskState,
    batch_status,
)
from aibrix_operators.batch.records import DEFAULT_COMPLETION_WINDOW
from aibrix_operators.batch.window_outlook import window_outlook
from aibrix_operators.batch_api import extensions
from aibrix_operators.batch_api.batches import API_CONF_KEY
from aibrix_operators.batch_api.ids import output_file_id
from aibrix_operators.trust.redact import scrub_addresses

__all__ = ["TERMINAL", "RunSnapshot", "TaskState", "batch_object", "batch_status"]
# The batch object's extension fields (beside OpenAI's, like monitor_url). Not in ``metadata``:
# that stays exactly what the client sent (OpenAI allows 16 pairs, and a batch created with 16
# must not come back with 17).
STATUS_LINE_KEY = extensions.STATUS_LINE
# batch.json's count of requests a cancel or the window left unanswered (BatchObject's field).
UNANSWERED_KEY = extensions.UNANSWERED
PARTIAL_OUTPUT_KEY = extensions.PARTIAL_OUTPUT_FILE_ID
SHARDS_KEY = extensions.SHARDS
PARTIAL_KIND = "partial"  # the partial output's file id: output_file_id(batch, PARTIAL_KIND)


def batch_object(snap: RunSnapshot, now: float | None = None, prices: Prices | None = None) -> dict[str, Any]:
    """The Batch object, OpenAI's fields in OpenAI's order; ids are the API's, never URIs.

    ``metadata`` is the client's, as sent. While the batch is in progress, the extension field
    ``aibrix_status`` says whether it will finish in its window at the rate measured so far
    (``batch/window_outlook.py``, the same judgement as the drivers' AT RISK lines, over the whole
    batch); null otherwise. With the deployment's ``prices``, ``aibrix_cost`` is what the answers so
    far cost, and ``batch.json``'s line once it ended."""
    api = snap.conf.get(API_CONF_KEY, {})
    published = snap.batch_json or {}
    status = batch_status(snap)
    created_at = int(api.get("created_at") or 0)
    window = snap.conf.get("completion_window", DEFAULT_COMPLETION_WINDOW)
    expires_at = _expires_at(created_at, window)
    validate, merge = snap.step(Step.VALIDATE), snap.step(Step.MERGE)
    # The moment the status became in_progress (validation done), live and after the end alike:
    # a value a client has read never changes. batch.json's own (the first request sent) only
    # stands in when the run's tasks are gone.
    validated = validate[0].end if validate and validate[0].state == "success" else None
    in_progress_at = validated or published.get("in_progress_at")
    counts = published.get("request_counts") if status in TERMINAL else None
    if counts is None:
        total = snap.total_requests or 0
        if snap.live_counts is not None:
            total, answered, errors = snap.live_counts
            counts = {"total": total, "completed": answered - errors, "failed": errors}
        else:
            counts = {"total": total, "completed": 0, "failed": 0}
    output_id = error_id = None
    if status in ENDED_WITH_OUTPUT:
        # Like error_file_id: no file id for an output with nothing in it (OpenAI's rule; a
        # batch cancelled or expired before any answer has no output file).
        if published.get("output_file_id") and counts.get("completed", 0) > 0:
            output_id = output_file_id(snap.batch_id, "output")
        if published.get("error_file_id") and counts.get("failed", 0) > 0:
            error_id = output_file_id(snap.batch_id, "errors")
    errors = published.get("errors") if status == BatchStatus.FAILED else None
    if status == BatchStatus.FAILED and not errors:
        errors = {"object": "list", "data": [{
            "code": BatchFailure.BATCH_RUN_FAILED,
            "message": "the batch's run failed before it published a result", "param": None, "line": None}]}
    if errors:
        hide = {str(snap.conf.get("input_uri") or "\0"): api.get("input_file_id", "the input file"),
                str(snap.conf.get("output_uri") or "\0"): "the batch's output"}
        errors = {"object": "list", "data": [_error_item(e, hide) for e in errors.get("data", [])]}
    ended = (snap.step(Step.RECORD_FAILURE) or [TaskState(None)])[0].end
    return {
        "id": snap.batch_id,
        "object": "batch",
        "endpoint": snap.conf.get("batch_endpoint", ""),
        "model": snap.conf.get("model"),
        "errors": errors,
        "input_file_id": api.get("input_file_id", ""),
        "completion_window": window,
        "status": str(status),
        "output_file_id": output_id,
        "error_file_id": error_id,
        "created_at": created_at,
        "in_progress_at": in_progress_at,
        "expires_at": expires_at,
        "finalizing_at": published.get("finalizing_at") or (
            _finalizing_since(merge, snap.step(Step.DISPATCH)) if status == BatchStatus.FINALIZING else None),
        "completed_at": published.get("completed_at") if status == BatchStatus.COMPLETED else None,
        "failed_at": (published.get("failed_at") or ended or created_at)
        if status == BatchStatus.FAILED else None,
        "expired_at": published.get("expired_at") if status == BatchStatus.EXPIRED else None,
        "cancelling_at": snap.cancel_at,
        "cancelled_at": published.get("cancelled_at") if status == BatchStatus.CANCELLED else None,
        "request_counts": {k: int(counts.get(k, 0)) for k in ("total", "completed", "failed")},
        "metadata": dict(snap.conf.get("metadata") or {}) or None,
        # OpenAI's usage, growing while the batch runs (the answers so far), merge's totals at the end.
        "usage": published.get("usage") if status in TERMINAL else snap.live_usage,
        STATUS_LINE_KEY: _status_line(snap, status, counts, in_progress_at, expires_at, now),
        UNANSWERED_KEY: _unanswered(published) if status in TERMINAL else None,
        # Results while the batch runs (docs/batch-api.md#partial-results): the finished shards'
        # answers, as a file whose content grows as shards finish; null once the batch ends.
        PARTIAL_OUTPUT_KEY: output_file_id(snap.batch_id, PARTIAL_KIND)
        if snap.shards_done and status not in TERMINAL else None,
        SHARDS_KEY: {"total": snap.shard_count, "done": len(snap.shards_done)}
        if snap.shard_count is not None and status not in TERMINAL else None,
        extensions.COST: published.get(extensions.COST) if status in TERMINAL
        else cost_line(snap.live_usage, prices),
        extensions.ESTIMATE: None if status in TERMINAL else _estimate(snap, counts, in_progress_at, now),
        extensions.OUTPUT_EXPIRES_AT: published.get(extensions.OUTPUT_EXPIRES_AT)
        if status in TERMINAL else None,
    }


def _unanswered(published: dict[str, Any]) -> int | None:
    value = published.get(UNANSWERED_KEY)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _expires_at(created_at: int, window: object) -> int | None:
    """The batch's deadline (batch/deadline.py: the run was triggered with ``run_after`` at this
    ``created_at``, so the weights and the drivers count from the same second); None for a window
    no parser reads (a run triggered another way than through the API, or before a rule
    tightened): the object is still shown."""
    if not created_at:
        return None
    try:
        return deadline(created_at, str(window))
    except ValueError:
        return None


def _status_line(snap: RunSnapshot, status: BatchStatus, counts: dict[str, int], in_progress_at: int | None,
                 expires_at: int | None, now: float | None) -> str | None:
    if status == BatchStatus.IN_PROGRESS and in_progress_at and expires_at and snap.live_counts is not None:
        now = time.time() if now is None else now
        answered = int(counts.get("completed", 0)) + int(counts.get("failed", 0))
        outlook = window_outlook(int(counts.get("total", 0)) - answered, answered, now - in_progress_at,
                                 expires_at - now)
        if outlook is not None:
            return outlook.line()
    return None


def _estimate(snap: RunSnapshot, counts: dict[str, int], in_progress_at: int | None,
              now: float | None) -> dict[str, Any] | None:
    """When the batch will be done: the estimate it was admitted with (batch/admission.py) until it has
    answers; then the tokens it has left — its unanswered requests at its own tokens per answer so
    far — at the endpoint's measured rate (the rate it was admitted with). Without a measured rate, its
    own rate so far, which counts the time it waited (for split, for earlier-deadline batches) as if it
    were slow: far off early on (bench/eta_real_stack.py, bench/RESULTS.md)."""
    answered = int(counts.get("completed", 0)) + int(counts.get("failed", 0))
    total = int(counts.get("total", 0))
    now = time.time() if now is None else now
    admitted = snap.estimate or {}
    if snap.live_counts is not None and answered > 0 and in_progress_at and now > in_progress_at:
        rate = admitted.get("tokens_per_s")
        so_far = (snap.live_usage or {}).get("total_tokens")
        if isinstance(rate, int | float) and rate > 0 and isinstance(so_far, int) and so_far > 0:
            left = (total - answered) * so_far / answered
            return {"completion_at": math.ceil(now + left / rate), "tokens_left": round(left),
                    "tokens_per_s": rate,
                    "basis": f"{round(left)} tokens left ({so_far} in its {answered} answers so far) at "
                             f"the endpoint's measured {rate} tokens/s"}
        elapsed = now - in_progress_at
        return {"completion_at": int(now + (total - answered) * elapsed / answered),
                "basis": f"this batch's own rate so far: {answered} answers in {elapsed:.0f} s "
                         "(no measured rate for its endpoint)"}
    if snap.estimate is not None:
        keep = ("completion_at", "basis", "feasible", "earliest_window", "tokens", "ahead_tokens",
                "tokens_per_s")
        return {k: snap.estimate.get(k) for k in keep}
    return None


def _finalizing_since(merge: list[TaskState], dispatch: list[TaskState]) -> int | None:
    """The merge task's start; while it waits for a slot, the end of the last shard (the status
    is finalizing from then on, and OpenAI's ``finalizing_at`` is never null while it is)."""
    if merge and merge[0].start is not None:
        return merge[0].start
    ends = [t.end for t in dispatch if t.end is not None]
    return max(ends) if ends else None




def _error_item(item: dict[str, Any], hide: dict[str, str]) -> dict[str, Any]:
    """Only OpenAI's BatchError fields; storage locations in messages become the API's names,
    and any other address an internal one, so a client never learns the deployment's layout
    (the task log keeps the detail; the code is the stable part)."""
    message = item.get("message")
    if isinstance(message, str):
        for uri, name in hide.items():
            message = message.replace(uri, name)
        message = scrub_addresses(message)
    return {"code": item.get("code"), "message": message, "param": item.get("param"),
            "line": item.get("line")}
