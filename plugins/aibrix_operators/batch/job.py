"""The batch's steps as plain functions: validate, split, run a shard, finalize.

Airflow operators call these; so do tests and the command line, without Airflow.
Layout under the output prefix::

    <output>/output.jsonl  errors.jsonl  batch.json
    <output>/_work/<run>/shards/shard-00000.jsonl          (inputs, one per mapped task)
    <output>/_work/<run>/results/shard-00000/seg-*.jsonl   (checkpointed results)
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

from aibrix_operators.batch.merging import BATCH_FILE, MergeSummary, merge_results
from aibrix_operators.batch.records import BatchObject, new_batch_id, parse_completion_window
from aibrix_operators.batch.sharding import ShardSpec, plan_shards, split_file
from aibrix_operators.batch.validation import LineError, ValidationLimits, ValidationReport, validate_stream
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.results import ResultLog, results_prefix
from aibrix_operators.driver.runner import ShardOutcome, run_shard
from aibrix_operators.storage import Storage, join_uri


def work_prefix(output_uri: str, run_id: str) -> str:
    """Per-run scratch space beside the outputs; run ids are made path- and key-safe."""
    return join_uri(output_uri, "_work", re.sub(r"[^A-Za-z0-9._-]+", "_", run_id))


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

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ValidatedBatch:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


def validate_batch(
    storage: Storage,
    input_uri: str,
    output_uri: str,
    endpoint: str | None = None,
    limits: ValidationLimits | None = None,
    completion_window: str = "24h",
    metadata: dict[str, str] | None = None,
    batch_id: str | None = None,
    expected_model: str | None = None,
) -> tuple[ValidationReport, ValidatedBatch | None]:
    """Validate the input; on failure write a failed ``batch.json`` to the output."""
    limits = limits or ValidationLimits()
    created_at = int(time.time())
    window_s = parse_completion_window(completion_window)
    batch_id = batch_id or new_batch_id()
    with storage.open_read(input_uri) as stream:
        report = validate_stream(stream, endpoint, limits, reopen=lambda: storage.open_read(input_uri))
    if expected_model and report.model and report.model != expected_model:
        report.error_count += 1
        report.errors.append(LineError(
            None, "mismatched_model",
            f"the file's requests use model {report.model!r} but this batch was submitted for "
            f"{expected_model!r}; fix body.model or the model parameter", "model",
        ))
    if not report.ok:
        batch = BatchObject(
            id=batch_id, endpoint=report.endpoint or endpoint or "", input_file_id=input_uri,
            completion_window=completion_window, status="failed", errors=report.as_openai_errors(),
            created_at=created_at, failed_at=int(time.time()), expires_at=created_at + window_s,
            metadata=metadata or None,
        )
        batch.request_counts["total"] = report.total_requests
        write_batch_object(storage, output_uri, batch)
        return report, None
    assert report.endpoint is not None and report.model is not None
    return report, ValidatedBatch(
        batch_id=batch_id, input_uri=input_uri, output_uri=output_uri, endpoint=report.endpoint,
        model=report.model, total_requests=report.total_requests, total_bytes=report.total_bytes,
        created_at=created_at, expires_at=created_at + window_s, completion_window=completion_window,
        metadata=metadata or {}, max_line_bytes=limits.max_line_bytes,
        last_request_line=report.last_request_line,
    )


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
    return split_file(storage, batch.input_uri, work, report, plan)


async def run_shard_of_batch(
    storage: Storage, shard: ShardSpec, work: str, config: DriverConfig
) -> ShardOutcome:
    return await run_shard(
        storage, shard.uri, results_prefix(work, shard.name), config,
        total=shard.num_requests, name=shard.name,
    )


def finalize_batch(
    storage: Storage,
    batch: ValidatedBatch,
    shards: list[ShardSpec],
    work: str,
    in_progress_at: int | None = None,
) -> tuple[MergeSummary, BatchObject]:
    finalizing_at = int(time.time())

    def segments_of(shard: ShardSpec) -> list[str]:
        return ResultLog(storage, results_prefix(work, shard.name)).segments()

    summary = merge_results(storage, shards, segments_of, batch.output_uri)
    obj = BatchObject(
        id=batch.batch_id, endpoint=batch.endpoint, input_file_id=batch.input_uri,
        completion_window=batch.completion_window, status="completed",
        output_file_id=summary.output_uri, error_file_id=summary.errors_uri,
        created_at=batch.created_at, in_progress_at=in_progress_at or batch.created_at,
        expires_at=batch.expires_at, finalizing_at=finalizing_at, completed_at=int(time.time()),
        request_counts={"total": summary.total, "completed": summary.completed, "failed": summary.failed},
        usage=summary.usage.as_dict(), metadata=batch.metadata or None,
    )
    write_batch_object(storage, batch.output_uri, obj)
    return summary, obj


def record_batch_failure(
    storage: Storage, batch: ValidatedBatch, code: str, message: str
) -> BatchObject:
    """Publish a failed ``batch.json`` when the run died after validation.

    Checkpointed results stay under the run's work prefix: clearing the failed
    tasks in Airflow resumes the run where it stopped.
    """
    obj = BatchObject(
        id=batch.batch_id, endpoint=batch.endpoint, input_file_id=batch.input_uri,
        completion_window=batch.completion_window, status="failed",
        errors={"object": "list", "data": [{"code": code, "message": message, "param": None,
                                            "line": None}], "total": 1},
        created_at=batch.created_at, expires_at=batch.expires_at, failed_at=int(time.time()),
        metadata=batch.metadata or None,
    )
    obj.request_counts["total"] = batch.total_requests
    write_batch_object(storage, batch.output_uri, obj)
    return obj


def write_batch_object(storage: Storage, output_uri: str, batch: BatchObject) -> str:
    uri = join_uri(output_uri, BATCH_FILE)
    storage.write_bytes(uri, json.dumps(batch.as_dict(), indent=2).encode() + b"\n")
    return uri
