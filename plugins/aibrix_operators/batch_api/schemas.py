"""Response shapes (OpenAI's, field for field) for the app's OpenAPI schema.

They document the API and let schemathesis check every answer against it; the
handlers build plain dicts (``status.batch_object``, ``StoredFile.as_openai``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from aibrix_operators.batch.lifecycle import BatchStatus


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["uploaded", "processed", "error"]
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class BatchError(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class ShardProgress(BaseModel):
    total: int
    done: int


class Batch(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None
    usage: dict[str, Any] | None = None
    # Not OpenAI's: the Airflow UI page of the batch's run (null when no public URL is set).
    monitor_url: str | None = None
    # Not OpenAI's: while in progress, whether the batch will finish in its window at the rate
    # measured so far ("on track: ..." / "at risk: ..."); null otherwise. Never in metadata.
    aibrix_status: str | None = None
    # Of request_counts.failed, the requests the cancel or the window's end left unanswered.
    aibrix_unanswered: int | None = None
    # Not OpenAI's: while in progress, a file of every finished shard's answers (its content
    # grows as shards finish), and the shards done of all; null before the first and at the end.
    aibrix_partial_output_file_id: str | None = None
    aibrix_shards: ShardProgress | None = None
    # Not OpenAI's: with deployment prices, the cost so far / in the end (docs/batch-api.md).
    aibrix_cost: dict[str, Any] | None = None
    # Not OpenAI's: until it ends, when the batch will be done and on what basis (docs/admission.md).
    aibrix_estimate: dict[str, Any] | None = None
    # Not OpenAI's: once it ended, when its output files expire (output_expires_after).
    aibrix_output_expires_at: int | None = None


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


class CreateBatch(BaseModel):
    input_file_id: str = Field(max_length=200)
    endpoint: str = Field(max_length=200)
    completion_window: str = Field(max_length=20)
    # Checked by hand (batches.check_metadata) so limits answer 400, as OpenAI does.
    metadata: dict[str, Any] | None = None
    output_expires_after: dict[str, Any] | None = None
    # Not OpenAI's: the job pool (docs/job-pool.md), e.g. {"max_workers": 2, "memory_per_job": "2Gi"};
    # the SDK sends it with extra_body. Checked by hand (batches.check_pool) to answer 400.
    pool: dict[str, Any] | None = None
    # Not OpenAI's: stop rules (docs/stop-rules.md), e.g. {"max_error_rate": 0.2}; with extra_body.
    # Checked by hand (batches.check_stop_rules) to answer 400.
    stop_rules: dict[str, Any] | None = None


class EstimateWork(BaseModel):
    """What a dry run counted in the batch file (the client counts it; batch/admission.Work)."""

    requests: int = Field(ge=0)
    input_bytes: int = Field(ge=0)
    max_output_tokens: int = Field(ge=0)
    unbounded_requests: int = Field(ge=0)


class EstimateRequest(BaseModel):
    """Not OpenAI's: a dry run (docs/admission.md#dry-run)."""

    model: str = Field(max_length=200)
    endpoint: str = Field(max_length=200)
    completion_window: str = Field(max_length=20)
    work: EstimateWork


class BatchEstimate(BaseModel):
    object: Literal["batch.estimate"]
    model: str
    endpoint: str
    completion_window: str
    work: EstimateWork
    # What the input-token figure rests on: bytes here (the file's text stays with the client); a
    # DAG dry run counts with the model's tokenizer where the deployment names one.
    input_tokens_basis: str
    estimate: dict[str, Any]
    cost: dict[str, Any] | None = None


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorBody} for code in codes}
