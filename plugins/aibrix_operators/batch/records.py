"""The OpenAI Batch API's line formats and the batch object.

Field names follow OpenAI's Batch API reference so that files produced here can
be read by anything that reads OpenAI batch output (and vLLM's ``run_batch``).
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aibrix_operators.batch.lifecycle import BatchStatus
from aibrix_operators.storage import is_s3, join_uri

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


# ------------------------------------------------------------ where a batch's objects go
def work_prefix(output_uri: str, run_id: str) -> str:
    """Per-run scratch space beside the outputs; run ids are made path- and key-safe."""
    return join_uri(output_uri, "_work", re.sub(r"[^A-Za-z0-9._-]+", "_", run_id))


# S3's limit on an object key: 1,024 bytes of UTF-8.
S3_MAX_KEY_BYTES = 1024
# The longest key a batch writes, past its run's work prefix (``<output>/_work/<run id>``): a
# driver's checkpoint segment, ``/results/shard-NNNNN/<binding>/seg-<attempt>-<seq>.jsonl`` with
# a 5-digit shard index (at most 1,024 shards), the 24-hex content binding (batch/shard_results.py's
# 12-byte blake2b), the attempt id (a 20-digit ns time, "-", 8 hex) and a 6-digit sequence (it
# grows past 6 digits only after a million flushes in one attempt: 11 days of 1 s flushes).
# Every other key is shorter: shards/shard-NNNNN.jsonl and .lines, prefix-order.npy and CANCEL
# under the work prefix; output.jsonl, errors.jsonl and batch.json beside _work/.
# tests/unit/test_output_key_length.py checks this against the keys job.py and the driver build.
LONGEST_WORK_KEY_SUFFIX = (len("/results/shard-00000/") + 24 + len("/seg-") + 20 + len("-") + 8
                           + len("-") + 6 + len(".jsonl"))


def longest_key_bytes(work: str) -> int:
    """The longest object key (UTF-8 bytes) a run writes under its work prefix ``work``."""
    key = work[len("s3://"):].partition("/")[2].lstrip("/") if is_s3(work) else work
    return len(key.encode()) + LONGEST_WORK_KEY_SUFFIX


def output_key_problem(work: str) -> str | None:
    """Why S3 cannot take every key the run with work prefix ``work`` writes, or None; the
    caller adds what to change (the output_uri, the drop's name)."""
    if not is_s3(work):
        return None
    longest = longest_key_bytes(work)
    if longest <= S3_MAX_KEY_BYTES:
        return None
    output = work.rsplit("/_work/", 1)[0]
    return (f"the batch would write S3 keys of up to {longest} bytes under {output[:100]}"
            f"{'...' if len(output) > 100 else ''}, over S3's limit of {S3_MAX_KEY_BYTES} bytes "
            f"by {longest - S3_MAX_KEY_BYTES}")


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


# The window of a batch that names none: OpenAI's only window, the pipeline's Param default. Its
# grammar is parse_completion_window's (below); a batch's deadline is batch/deadline.py's.
DEFAULT_COMPLETION_WINDOW = "24h"


@dataclass
class BatchObject:
    """OpenAI's Batch object, as written to ``batch.json``."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str = DEFAULT_COMPLETION_WINDOW
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
    # Extension, only on a batch a cancel or its window's end cut short (OpenAI's fields otherwise):
    # of request_counts.failed, the requests left unanswered (error code batch_cancelled /
    # batch_expired), so such a batch does not read as a mass failure.
    aibrix_unanswered: int | None = None
    # Extension, only on a batch that asked for output_expires_after: when its output and error
    # files expire (their creation, merge's end, plus the seconds asked; batch/output_expiry.py).
    aibrix_output_expires_at: int | None = None
    # Extension, on a deployment that sets prices: what the batch cost (batch/cost.py's cost line).
    aibrix_cost: dict[str, Any] | None = None
    # Extension: the engine time the batch used, summed over its shards' runs (driver/engine_time.py);
    # None when an endpoint did not report its token counters.
    aibrix_engine_s: float | None = None
    # Extension: the estimate the batch was admitted with (batch/admission.py), kept to compare.
    aibrix_estimate: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # A plain str: the object goes to XCom and JSON, which need not know the enum.
        self.status = str(BatchStatus(self.status))

    def as_dict(self) -> dict[str, Any]:
        out = {"id": self.id, "object": "batch"}
        out.update({k: v for k, v in self.__dict__.items()
                    if k != "id" and not (k.startswith("aibrix_") and v is None)})
        return out


# The digits of a window: ASCII only (``str.isdigit`` takes any script's digits, ``"١h"``), and few
# enough that no caller's arithmetic or datetime overflows (999,999,999h is far past any use).
_WINDOW = re.compile(r"(?P<n>[0-9]{1,9})(?P<unit>[hms])")
_WINDOW_UNITS = {"h": 3600, "m": 60, "s": 1}
# The shortest completion_window a deployment accepts unless it says otherwise
# ([aibrix_batch] min_completion_window): batches are ordered by deadline, so without a floor a
# tiny window would put its batch first every time.
DEFAULT_MIN_COMPLETION_WINDOW = "1h"
# Where the deployment sets it (settings/completion_window.py reads it); messages name it.
MIN_WINDOW_SETTING = "[aibrix_batch] min_completion_window"


class WindowTooShort(ValueError):
    """A completion_window under the deployment's minimum; the message says how to fix it."""


def parse_completion_window(window: str) -> int:
    """``"24h"``/``"90m"``/``"3600s"`` → seconds; OpenAI accepts only ``24h``, we accept any."""
    match = _WINDOW.fullmatch(window) if isinstance(window, str) else None
    if match is None:
        raise ValueError(
            f"completion_window {str(window)[:40]!r} is not a duration like '24h', '90m' or '3600s'"
        )
    seconds = int(match["n"]) * _WINDOW_UNITS[match["unit"]]
    if seconds <= 0:
        raise ValueError(f"completion_window {window!r} must be positive")
    return seconds


def format_window(seconds: int) -> str:
    """``3600`` -> ``"1h"``, ``5400`` -> ``"90m"``, ``45`` -> ``"45s"``: the shortest exact form."""
    for unit in ("h", "m", "s"):
        if seconds % _WINDOW_UNITS[unit] == 0:
            return f"{seconds // _WINDOW_UNITS[unit]}{unit}"
    raise AssertionError("unreachable: every whole number of seconds has a form in s")


def check_min_window(window: str, minimum_s: int) -> int:
    """``window`` in seconds; WindowTooShort when it is under ``minimum_s`` (the deployment's
    ``MIN_WINDOW_SETTING``)."""
    seconds = parse_completion_window(window)
    if seconds < minimum_s:
        least = format_window(minimum_s)
        raise WindowTooShort(
            f"completion_window {window!r} is shorter than this deployment's minimum of {least} "
            f"({MIN_WINDOW_SETTING}); ask for a completion_window of at least {least}, e.g. '{least}'"
        )
    return seconds
