"""The OpenAI Batch API's line formats and the batch object.

Field names follow OpenAI's Batch API reference so that files produced here can
be read by anything that reads OpenAI batch output (and vLLM's ``run_batch``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aibrix_operators.batch.lifecycle import BatchStatus

# OpenAI Batch's endpoints (chat, completions, embeddings, responses) and the pooling ones vLLM's
# run_batch takes (score, rerank); batch/endpoints.py checks the bodies of the last three.
SUPPORTED_ENDPOINTS: tuple[str, ...] = (
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings",
    "/v1/responses", "/v1/score", "/v1/rerank",
)
# OpenAI's limits, used as defaults; every one of them is a parameter.
DEFAULT_MAX_REQUESTS = 50_000
DEFAULT_MAX_FILE_BYTES = 200 * 1024 * 1024
DEFAULT_MAX_LINE_BYTES = 4 * 1024 * 1024


def new_request_record_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def success_record(custom_id: str, status_code: int, request_id: str, body: Any) -> dict[str, Any]:
    """One line of ``output.jsonl``: a request that got a 2xx response."""
    return {
        "id": new_request_record_id(),
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": None,
    }


def error_record(
    custom_id: str,
    code: str,
    message: str,
    status_code: int | None = None,
    request_id: str | None = None,
    body: Any = None,
) -> dict[str, Any]:
    """One line of ``errors.jsonl``: a request that ended without a 2xx response.

    ``response`` carries the last HTTP response when there was one, so a user
    can see what the server said; it is null for timeouts and dropped connections.
    """
    response = None
    if status_code is not None:
        response = {"status_code": status_code, "request_id": request_id, "body": body}
    return {
        "id": new_request_record_id(),
        "custom_id": custom_id,
        "response": response,
        "error": {"code": code, "message": message},
    }


@dataclass
class Usage:
    """Token totals over a batch, in the Batch object's ``usage`` shape."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0

    def add_response_body(self, body: Any) -> None:
        """Add a response's ``usage``; a missing or malformed one counts as zero, never raises.

        Whatever a server answers must end as a result line, so a ``"prompt_tokens": "n/a"``
        only loses that response's share of the totals.
        """
        self.add_usage(body.get("usage") if isinstance(body, dict) else None)

    def add_usage(self, usage: Any) -> None:
        """``add_response_body`` for a body's ``usage`` alone."""
        if not isinstance(usage, dict):
            return
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if prompt is None and completion is None:
            # /v1/responses counts input/output tokens, under OpenAI's Responses names.
            prompt, completion = usage.get("input_tokens"), usage.get("output_tokens")
            details = usage.get("input_tokens_details")
            if isinstance(details, dict):
                self.cached_tokens += _token_count(details.get("cached_tokens"))
        # Fast path (once per answer in the driver): plain non-negative ints, no call.
        if type(prompt) is int and type(completion) is int and prompt >= 0 and completion >= 0:
            self.input_tokens += prompt
            self.output_tokens += completion
        else:
            self.input_tokens += _token_count(prompt)
            self.output_tokens += _token_count(completion)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            self.cached_tokens += _token_count(details.get("cached_tokens"))

    def merge(self, other: Usage) -> None:
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.cached_tokens += other.cached_tokens

    def as_dict(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + self.output_tokens,
        }


def _token_count(value: Any) -> int:
    # bool is an int subclass; a count is a non-negative whole number below 2**53.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    if value != value or not 0 <= value < 2**53:  # NaN, negative, infinite or absurd
        return 0
    return int(value)


@dataclass
class BatchObject:
    """OpenAI's Batch object, as written to ``batch.json``."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str = "24h"
    status: str = BatchStatus.VALIDATING
    model: str | None = None  # the lines' body.model (one per batch; validation checks it)
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: dict[str, Any] | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: dict[str, int] = field(
        default_factory=lambda: {"total": 0, "completed": 0, "failed": 0}
    )
    usage: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None

    def __post_init__(self) -> None:
        # A plain str: the object goes to XCom and JSON, which need not know the enum.
        self.status = str(BatchStatus(self.status))

    def as_dict(self) -> dict[str, Any]:
        out = {"id": self.id, "object": "batch"}
        out.update({k: v for k, v in self.__dict__.items() if k != "id"})
        return out


def parse_completion_window(window: str) -> int:
    """``"24h"``/``"90m"``/``"3600s"`` → seconds; OpenAI accepts only ``24h``, we accept any."""
    units = {"h": 3600, "m": 60, "s": 1}
    if not window or window[-1] not in units or not window[:-1].isdigit():
        raise ValueError(
            f"completion_window {window!r} is not a duration like '24h', '90m' or '3600s'"
        )
    seconds = int(window[:-1]) * units[window[-1]]
    if seconds <= 0:
        raise ValueError(f"completion_window {window!r} must be positive")
    return seconds
