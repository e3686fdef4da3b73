"""The batch's steps as plain functions: validate, split, run a shard, finalize.

Airflow operators call these; so do tests and the command line, without Airflow.
Layout under the output prefix::

    <output>/output.jsonl  errors.jsonl  batch.json
    <output>/_work/<run>/shards/shard-00000.jsonl          (inputs, one per mapped task)
    <output>/_work/<run>/results/shard-00000/seg-*.jsonl   (checkpointed results)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np

from aibrix_operators.batch.admission import Admission, Estimate, endpoint_key
from aibrix_operators.batch.cost import Prices, cost_line
from aibrix_operators.batch.deadline import deadline
from aibrix_operators.batch.error_codes import UNANSWERED as UNANSWERED_CODES
from aibrix_operators.batch.error_codes import BatchFailure, RequestError, ValidationCode
from aibrix_operators.batch.failures import (
    FailureRecord,
    error_list,
    failed_batch,
    one_line,
    publish_failure,
    storage_error_code,
)
from aibrix_operators.batch.grouped_split import split_grouped
from aibrix_operators.batch.lifecycle import BatchStatus
from aibrix_operators.batch.merging import BATCH_FILE, MergeSummary, merge_results
from aibrix_operators.batch.output_expiry import parse_expires_after
from aibrix_operators.batch.prefixes import (
    MAX_GROUPED_REQUESTS,
    PrefixSignatures,
    grouping_order,
    read_order,
    worth_grouping,
    write_order,
)
from aibrix_operators.batch.prompt_tokens import PromptCounter
from aibrix_operators.batch.records import (  # noqa: F401 - the layout's helpers, re-exported
    DEFAULT_COMPLETION_WINDOW,
    DEFAULT_MIN_COMPLETION_WINDOW,
    LONGEST_WORK_KEY_SUFFIX,
    S3_MAX_KEY_BYTES,
    BatchObject,
    check_min_window,
    longest_key_bytes,
    new_batch_id,
    output_key_problem,
    parse_completion_window,
    work_prefix,
)
from aibrix_operators.batch.shard_results import results_prefix, shard_result_log
from aibrix_operators.batch.sharding import ShardSpec, plan_shards, split_file
from aibrix_operators.batch.stop_rules import StopReason, StopRules, stop_marker_uri
from aibrix_operators.batch.validation import ValidationLimits, ValidationReport, validate_stream
from aibrix_operators.storage import Storage, StorageError, join_uri

log = logging.getLogger(__name__)


def prefix_order_uri(work: str) -> str:
    """Where validate writes the grouped send order for split (prefix-aware sharding)."""
    return join_uri(work, "prefix-order.npy")


def cancel_marker_uri(work: str) -> str:
    """The object whose existence cancels the run's drivers (``driver/cancel.py``)."""
    return join_uri(work, "CANCEL")


def request_cancel(storage: Storage, work: str, reason: str = "cancelled by the user") -> str:
    """Cancel a running batch: its drivers stop sending within ``cancel_poll_s``; merge then
    publishes status ``cancelled`` with every unanswered request as ``batch_cancelled``."""
    uri = cancel_marker_uri(work)
    storage.write_bytes(uri, json.dumps({"reason": reason, "at": int(time.time())}).encode())
    return uri


@dataclass
class ValidatedBatch:
    """What validation hands to the later steps (travels through XCom as a dict)."""

    batch_id: str
    input_uri: str
    output_uri: str
    endpoint: str
    model: str
    total_requests: int
    total_bytes: int
    created_at: int
    expires_at: int
    completion_window: str
    metadata: dict[str, str]
    max_line_bytes: int
    last_request_line: int
    # Prefix-aware sharding (batch/prefixes.py): where validate wrote the grouped send order,
    # or None when the batch is sent in input order; and what validation found.
    prefix_order_uri: str | None = None
    prefix_groups: int = 0
    prefix_shared_requests: int = 0
    # LoRA adapters of ``model`` that lines name, in first-seen order (docs/lora.md): the
    # order file's model k is adapters[k - 1].
    adapters: list[str] = dataclasses.field(default_factory=list)
    # The batch's stop rules (batch/stop_rules.py, as checked by validate), or None for none.
    stop_rules: dict[str, Any] | None = None
    # OpenAI's output_expires_after, in seconds from the output's creation; None: kept.
    output_expires_after_s: int | None = None
    # Admission (batch/admission.py): the estimate it was admitted with, and its rate's key (merge
    # learns the rate and takes the batch's work off the queue); None without a state root.
    estimate: dict[str, Any] | None = None
    admission_key: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ValidatedBatch:
        # Fields with defaults may be absent from an XCom written before they existed.
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def validate_batch(
    storage: Storage,
    input_uri: str,
    output_uri: str,
    endpoint: str | None = None,
    limits: ValidationLimits | None = None,
    completion_window: str = DEFAULT_COMPLETION_WINDOW,
    metadata: dict[str, str] | None = None,
    batch_id: str | None = None,
    expected_model: str | None = None,
    output_storage: Storage | None = None,
    prefix_grouping: str = "off",
    prefix_order_uri: str | None = None,
    adapters: dict[str, str] | None = None,
    min_window_s: int | None = None,
    submitted_at: int | None = None,
    stop_rules: dict[str, Any] | None = None,
    max_batch_tokens: int | None = None,
    output_expires_after: dict[str, Any] | None = None,
    admission: Admission | None = None,
    dry_run: bool = False,
    count_tokens: PromptCounter | None = None,
) -> tuple[ValidationReport, ValidatedBatch | None]:
    """Validate the input; on any failure write a failed ``batch.json`` to the output.

    Failures before the content can be judged — a bad ``completion_window``, an
    input that is missing or that these credentials may not read, a read that
    breaks off — are reported like content errors: one error with a specific
    code (``invalid_completion_window``, ``input_not_found``,
    ``input_access_denied``, ``input_unreadable``). ``report.record`` says where
    the failed ``batch.json`` went, or why it could not be written.

    ``prefix_grouping="auto"`` with a ``prefix_order_uri`` also collects prefix signatures
    and, when the file has shared prefixes worth grouping, writes the grouped send order
    there for ``split_batch`` (``batch/prefixes.py``); ``"off"`` keeps input order.

    ``adapters`` (the deployment's LoRA adapters, name -> base model) lets lines name adapters
    of the batch's base model; a batch that does is always sent grouped by adapter (prefix
    grouping decides the order inside each adapter's requests), which needs ``prefix_order_uri``.

    ``min_window_s``: the shortest window accepted (the operator passes the deployment's
    ``[aibrix_batch] min_completion_window``, ``settings/completion_window.py``; None: the default
    1h). A shorter window fails the batch with ``invalid_completion_window``, saying the minimum.
    This module imports no Airflow (the driver image and the router use it), so it reads no config.

    ``submitted_at``: when the batch was submitted (``batch/deadline.py``: its run's ``run_after``),
    the ``created_at`` its window runs from: ``expires_at`` is the deadline the API shows and the
    drivers enforce, however long the batch waited for this step. None: now.

    ``stop_rules``: the batch's (``batch/stop_rules.py``: ``max_error_rate``, ``error_rate_min_sample``,
    ``max_total_tokens``), checked here once, under the deployment's ``max_batch_tokens`` (a batch
    without a budget gets it); a bad one fails the batch with ``invalid_stop_rules``.

    ``output_expires_after``: OpenAI's ``{"anchor": "created_at", "seconds": N}``
    (batch/output_expiry.py); a bad one fails the batch with ``invalid_output_expires_after``.

    ``admission``: judge the valid batch's window at the endpoint's measured rate (batch/admission.py):
    admitted with its estimate (and queued), or, when the deployment refuses infeasible windows and
    this one is, failed with ``window_infeasible`` naming the shortest window that would be met.

    ``dry_run``: validate and estimate only (docs/admission.md#dry-run): the batch is judged at
    the measured rate whatever the admission mode, never queued nor refused for its window (the
    estimate says whether it would be met), and no send order is written. ``count_tokens`` (a dry
    run's, batch/prompt_tokens.py) counts the input tokens with the model's tokenizer.
    """
    if prefix_grouping not in ("auto", "off"):
        raise ValueError(f"prefix_grouping must be 'auto' or 'off', not {prefix_grouping!r}")
    # Where a send order goes; a dry run writes none, so it collects no signatures either.
    order_uri_wanted = None if dry_run else prefix_order_uri
    by_model = bool(adapters) and order_uri_wanted is not None
    # By model there is no ceiling: a batch naming adapters must be split by adapter.
    signatures = (PrefixSignatures(max_requests=None if by_model else MAX_GROUPED_REQUESTS)
                  if order_uri_wanted and (prefix_grouping == "auto" or by_model) else None)
    model_ids = array("H") if by_model else None
    limits = limits or ValidationLimits()
    created_at = int(time.time()) if submitted_at is None else submitted_at
    batch_id = batch_id or new_batch_id()
    report = ValidationReport(endpoint=endpoint)
    window_s: int | None = None
    try:
        if min_window_s is None:
            min_window_s = parse_completion_window(DEFAULT_MIN_COMPLETION_WINDOW)
        window_s = check_min_window(completion_window, min_window_s)
    except ValueError as exc:
        report.add_error(None, ValidationCode.INVALID_COMPLETION_WINDOW, str(exc), "completion_window")
    # The batch's deadline, once (batch/deadline.py): admission, a failed record and the batch read it.
    due = deadline(created_at, completion_window) if window_s else None
    rules: StopRules | None = None
    try:
        rules = StopRules.from_dict(stop_rules).within(max_batch_tokens)
    except (ValueError, TypeError) as exc:
        report.add_error(None, ValidationCode.INVALID_STOP_RULES, str(exc), "stop_rules")
    expires_after_s: int | None = None
    try:
        expires_after_s = parse_expires_after(output_expires_after)
    except ValueError as exc:
        report.add_error(None, ValidationCode.INVALID_OUTPUT_EXPIRES_AFTER, str(exc), "output_expires_after")
    # The run's work prefix is the parent of its prefix-order file (the operator names it): keys
    # too long for S3 fail the batch now, not in dispatch once the work is done.
    too_long = output_key_problem(prefix_order_uri.rsplit("/", 1)[0]) if prefix_order_uri else None
    if too_long:
        report.add_error(None, BatchFailure.INVALID_OUTPUT_URI,
                         f"{too_long}; choose an output_uri that much shorter", "output_uri")
    if report.ok:
        try:
            with storage.open_read(input_uri) as stream:
                report = validate_stream(
                    stream, endpoint, limits, reopen=lambda: storage.open_read(input_uri),
                    signatures=signatures, adapters=adapters, model_ids=model_ids, count_tokens=count_tokens,
                )
        except Exception as exc:
            if not _is_storage_failure(exc):
                raise
            report = ValidationReport(endpoint=endpoint)
            message = str(exc) if isinstance(exc, StorageError) else f"cannot read {input_uri}: {exc}"
            report.add_error(None, storage_error_code(exc), one_line(message), "input_uri")
    judged: Estimate | None = None
    work = report.work()
    if admission is not None and report.ok and report.model and (admission.mode != "off" or dry_run):
        assert due is not None  # a valid report has a valid window
        judged = admission.judge(report.model, work, batch_id, created_at, due, time.time())
        if judged.feasible is False and not dry_run:
            late = judged.why_late()
            if admission.mode == "refuse":
                report.add_error(None, ValidationCode.WINDOW_INFEASIBLE,
                                 f"{late}: ask for completion_window {judged.earliest_window} or more",
                                 "completion_window")
            else:
                log.warning("batch %s is at risk: %s", batch_id, late)
    if expected_model and report.model and report.model != expected_model:
        report.add_error(
            None, ValidationCode.MISMATCHED_MODEL,
            f"the file's requests use model {report.model!r} but this batch was submitted for "
            f"{expected_model!r}; fix body.model or the model parameter", "model",
        )
    if not report.ok:
        batch = failed_batch(
            batch_id=batch_id, input_uri=input_uri, errors=report.as_openai_errors(),
            endpoint=report.endpoint or endpoint or "", completion_window=completion_window,
            created_at=created_at, expires_at=due,
            total_requests=report.total_requests, metadata=metadata,
        )
        report.record = publish_failure(output_storage or storage, output_uri, batch)
        return report, None
    assert report.endpoint is not None and report.model is not None and window_s is not None
    if report.adapter_counts and not by_model and not dry_run:
        raise ValueError("a batch naming LoRA adapters is split by adapter: validate_batch needs a "
                         "prefix_order_uri for its send order")
    assert due is not None
    if judged is not None and not dry_run and not admission.admit(report.model, batch_id, due, work):
        log.warning("batch %s: the admission queue could not take its work; later estimates miss it",
                    batch_id)
    order_uri, groups, shared = None, 0, 0
    if signatures is not None and signatures.dropped_at is not None:
        log.info("prefix grouping skipped: the batch has %d requests, over the %d that are grouped "
                 "(batch/prefixes.py MAX_GROUPED_REQUESTS); sent in file order",
                 report.total_requests, signatures.dropped_at)
    if signatures is not None and len(signatures) == report.total_requests:
        models = (np.frombuffer(model_ids, dtype=np.uint16)
                  if model_ids is not None and report.adapter_counts else None)
        grouping = grouping_order(signatures, models, by_prefix=prefix_grouping == "auto")
        del signatures, models
        groups, shared = grouping.groups, grouping.shared_requests
        if worth_grouping(grouping):
            assert prefix_order_uri is not None
            write_order(output_storage or storage, prefix_order_uri, grouping)
            order_uri = prefix_order_uri
    return report, ValidatedBatch(
        batch_id=batch_id, input_uri=input_uri, output_uri=output_uri, endpoint=report.endpoint,
        model=report.model, total_requests=report.total_requests, total_bytes=report.total_bytes,
        created_at=created_at, expires_at=due,
        completion_window=completion_window,
        metadata=metadata or {}, max_line_bytes=limits.max_line_bytes,
        last_request_line=report.last_request_line,
        prefix_order_uri=order_uri, prefix_groups=groups, prefix_shared_requests=shared,
        adapters=list(report.adapter_counts),
        stop_rules=rules.as_dict() if rules is not None and rules.active else None,
        output_expires_after_s=expires_after_s,
        estimate=judged.as_dict() if judged is not None else None,
        admission_key=endpoint_key(report.model, admission.endpoint) if judged is not None else None,
    )


def _is_storage_failure(exc: BaseException) -> bool:
    """A failure of the store or the network under it, as opposed to a bug of ours."""
    if isinstance(exc, StorageError | OSError):
        return True
    return type(exc).__module__.split(".")[0] in ("botocore", "urllib3", "boto3")


def split_batch(
    storage: Storage,
    batch: ValidatedBatch,
    work: str,
    requests_per_shard: int,
    bytes_per_shard: int,
    max_shards: int,
) -> list[ShardSpec]:
    plan = plan_shards(
        batch.total_requests, batch.total_bytes, requests_per_shard, bytes_per_shard,
        max_shards, batch.max_line_bytes,
    )
    report = ValidationReport(
        endpoint=batch.endpoint, model=batch.model, total_requests=batch.total_requests,
        total_bytes=batch.total_bytes, last_request_line=batch.last_request_line,
    )
    if batch.prefix_order_uri:
        order, offsets, models = read_order(storage, batch.prefix_order_uri)
        return split_grouped(storage, batch.input_uri, work, report, plan, order, offsets,
                             models, batch.adapters)
    return split_file(storage, batch.input_uri, work, report, plan)


def finalize_batch(
    storage: Storage,
    batch: ValidatedBatch,
    shards: list[ShardSpec],
    work: str,
    in_progress_at: int | None = None,
    prices: Prices | None = None,
    engine_s: float | None = None,
) -> tuple[MergeSummary, BatchObject]:
    """Merge every shard's results and publish ``batch.json``.

    The status is ``failed`` when a stop rule stopped the batch (its marker says which; the
    answers so far are in the output, the rest ``batch_stopped`` lines), else ``cancelled`` when
    requests were left unanswered by a cancel
    (``batch_cancelled`` lines), else ``expired`` (OpenAI's) when the completion window
    ended with requests unanswered (``batch_expired`` lines); the answers that did come
    are in the output file either way.
    """
    finalizing_at = int(time.time())

    def segments_of(shard: ShardSpec) -> list[str]:
        return shard_result_log(storage, results_prefix(work, shard.name), shard.uri).segments()

    summary = merge_results(storage, shards, segments_of, batch.output_uri)
    ended = int(time.time())
    stopped = _stop_reason(storage, work) if batch.stop_rules else None
    cancelled = stopped is None and (summary.error_codes.get(RequestError.BATCH_CANCELLED, 0) > 0
                                     or storage.exists(cancel_marker_uri(work)))
    expired = (stopped is None and not cancelled
               and summary.error_codes.get(RequestError.BATCH_EXPIRED, 0) > 0)
    status = (BatchStatus.FAILED if stopped else BatchStatus.CANCELLED if cancelled
              else BatchStatus.EXPIRED if expired else BatchStatus.COMPLETED)
    unanswered = sum(summary.error_codes.get(code, 0) for code in UNANSWERED_CODES)
    obj = BatchObject(
        id=batch.batch_id, endpoint=batch.endpoint, input_file_id=batch.input_uri,
        completion_window=batch.completion_window, status=status, model=batch.model,
        output_file_id=summary.output_uri, error_file_id=summary.errors_uri,
        created_at=batch.created_at, in_progress_at=in_progress_at or batch.created_at,
        expires_at=batch.expires_at, finalizing_at=finalizing_at,
        completed_at=ended if status == BatchStatus.COMPLETED else None,
        expired_at=ended if expired else None, cancelled_at=ended if cancelled else None,
        failed_at=ended if stopped else None,
        errors=error_list(stopped.code, stopped.message, "stop_rules") if stopped else None,
        request_counts={"total": summary.total, "completed": summary.completed, "failed": summary.failed},
        usage=summary.usage.as_dict(), metadata=batch.metadata or None,
        aibrix_unanswered=unanswered if stopped or cancelled or expired else None,
        aibrix_output_expires_at=_output_expiry(ended, batch),
        aibrix_cost=cost_line(summary.usage.as_dict(), prices, engine_s),
        aibrix_engine_s=engine_s,
        aibrix_estimate=batch.estimate,
    )
    write_batch_object(storage, batch.output_uri, obj)
    return summary, obj


def _output_expiry(ended: int, batch: ValidatedBatch) -> int | None:
    """When the batch's output files (created now, at ``ended``) expire, if it asked."""
    return ended + batch.output_expires_after_s if batch.output_expires_after_s else None


def _stop_reason(storage: Storage, work: str) -> StopReason | None:
    """The stop rule that stopped the run's drivers (batch/stop_rules.py), if one did."""
    uri = stop_marker_uri(work)
    return StopReason.from_bytes(storage.read_bytes(uri)) if storage.exists(uri) else None


def record_batch_failure(
    storage: Storage, batch: ValidatedBatch, code: str, message: str
) -> FailureRecord:
    """Publish a failed ``batch.json`` when the run died after validation.

    Checkpointed results stay under the run's work prefix: clearing the failed
    tasks in Airflow resumes the run where it stopped. A store that cannot take
    the record is reported in the returned ``FailureRecord``, not raised.
    """
    obj = failed_batch(
        batch_id=batch.batch_id, input_uri=batch.input_uri, errors=error_list(code, message),
        endpoint=batch.endpoint, completion_window=batch.completion_window,
        created_at=batch.created_at, expires_at=batch.expires_at,
        total_requests=batch.total_requests, metadata=batch.metadata,
    )
    return publish_failure(storage, batch.output_uri, obj)


def write_batch_object(storage: Storage, output_uri: str, batch: BatchObject) -> str:
    uri = join_uri(output_uri, BATCH_FILE)
    storage.write_bytes(uri, json.dumps(batch.as_dict(), indent=2).encode() + b"\n")
    return uri
