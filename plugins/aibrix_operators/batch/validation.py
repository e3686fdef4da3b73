"""Streaming validation of an OpenAI Batch JSONL file.

The file is read line by line and never held whole; the only state that grows
with the file is 12 bytes per request (a 64-bit hash of its ``custom_id`` and
its line number), used to find duplicate ids at the end. Errors are reported
like OpenAI's batch ``errors`` object: line number, code, message, param.

The input is hostile until proven otherwise, so what it can make us keep is
bounded too: a run of blank lines is a counter, not a list; a user value echoed
in a message is cut to ``MAX_ECHO_CHARS``; every message to ``MAX_MESSAGE_CHARS``;
and only ``max_reported_errors`` errors are listed. The report (batch.json and
the log line) is therefore at most ~100 × 1 KB, whatever the file holds.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from aibrix_operators.batch.admission import Work, output_limit
from aibrix_operators.batch.duplicate_ids import IdHashLog, duplicate_ids
from aibrix_operators.batch.endpoints import BODY_CHECKS, VLLM_ALIASES
from aibrix_operators.batch.error_codes import ValidationCode
from aibrix_operators.batch.jsonl_lines import UTF8_BOM, skip_newlines, skip_rest_of_line
from aibrix_operators.batch.line_json import parse_line
from aibrix_operators.batch.prefixes import PrefixSignatures
from aibrix_operators.batch.prompt_tokens import PromptCounter
from aibrix_operators.batch.records import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_LINE_BYTES,
    DEFAULT_MAX_REQUESTS,
    SUPPORTED_ENDPOINTS,
)

# A user value quoted in a message is cut to this many characters.
MAX_ECHO_CHARS = 200
# Any message (ours plus echoed values plus a parser's text) is cut to this.
MAX_MESSAGE_CHARS = 1000


def echo(value: Any) -> str:
    """``repr(value)`` for a message, cut so that a 4 MiB value costs ~200 characters.

    Long strings are sliced before ``repr`` so a huge value is never copied whole.
    """
    if isinstance(value, str) and len(value) > MAX_ECHO_CHARS:
        return f"{value[:MAX_ECHO_CHARS]!r}... ({len(value)} characters)"
    text = repr(value)
    if len(text) > MAX_ECHO_CHARS:
        return f"{text[:MAX_ECHO_CHARS]}... ({len(text)} characters)"
    return text


def _bounded(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[:MAX_MESSAGE_CHARS] + f"... (message cut, {len(message)} characters)"


@dataclass(frozen=True)
class ValidationLimits:
    max_requests: int = DEFAULT_MAX_REQUESTS
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    max_reported_errors: int = 100


@dataclass(frozen=True)
class LineError:
    line: int | None
    code: str
    message: str
    param: str | None = None

    def as_openai(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass
class ValidationReport:
    """What validation learned about a file: its shape if valid, its errors if not."""

    endpoint: str | None = None
    # The batch's base model: the first line's body.model, or the base of the adapter it names.
    model: str | None = None
    # LoRA adapters of ``model`` that lines name (docs/lora.md), in first-seen order, with how
    # many lines name each; their ids in the per-request model column are 1, 2, ... in this order.
    adapter_counts: dict[str, int] = field(default_factory=dict)
    # The deployment's adapters (name -> base model), given to validate_stream.
    adapter_bases: dict[str, str] = field(default_factory=dict, repr=False)
    adapter_ids: dict[str, int] = field(default_factory=dict, repr=False)
    total_requests: int = 0
    total_bytes: int = 0
    # What bounds the batch's output (batch/admission.py): the sum of the lines' max_tokens, and the
    # lines without one.
    max_output_tokens: int = 0
    unbounded_requests: int = 0
    # Input tokens counted with the model's tokenizer (a dry run, batch/prompt_tokens.py); None when
    # not counted.
    input_tokens: int | None = None
    # The number of the last line that holds a request (trailing blank lines excluded).
    last_request_line: int = 0
    errors: list[LineError] = field(default_factory=list)
    error_count: int = 0
    # Where a failed batch's batch.json went (a batch.failures.FailureRecord), set by job.py.
    record: Any = None

    def work(self) -> Work:
        """What the batch's estimate rests on (batch/admission.py): admission, both dry runs."""
        return Work(self.total_requests, self.total_bytes, self.max_output_tokens, self.unbounded_requests,
                    self.input_tokens)

    @property
    def ok(self) -> bool:
        return self.error_count == 0

    def add_error(self, line: int | None, code: str, message: str, param: str | None = None) -> None:
        """Add an error found outside the line scan (a parameter, the file as a whole)."""
        self.error_count += 1
        self.errors.append(LineError(line, code, _bounded(message), param))

    def as_openai_errors(self) -> dict[str, Any]:
        """OpenAI's ``errors`` object; ``total`` counts errors beyond the listed ones."""
        return {
            "object": "list",
            "data": [e.as_openai() for e in self.errors],
            "total": self.error_count,
        }

    def summary(self) -> str:
        if self.ok:
            adapters = (f" and adapter(s) {', '.join(f'{a} ({n})' for a, n in self.adapter_counts.items())}"
                        if self.adapter_counts else "")
            return (
                f"valid batch: {self.total_requests} requests, {self.total_bytes} bytes, "
                f"endpoint {self.endpoint}, model {self.model}{adapters}"
            )
        shown = "\n".join(
            f"  line {e.line}: [{e.code}] {e.message}" if e.line else f"  [{e.code}] {e.message}"
            for e in self.errors
        )
        more = self.error_count - len(self.errors)
        tail = f"\n  ... and {more} more" if more > 0 else ""
        return f"batch input failed validation with {self.error_count} error(s):\n{shown}{tail}"


class BatchValidationError(Exception):
    """Raised by callers that want an exception; carries the full report."""

    def __init__(self, report: ValidationReport) -> None:
        super().__init__(report.summary())
        self.report = report


class _Collector:
    def __init__(self, report: ValidationReport, cap: int) -> None:
        self.report = report
        self.cap = cap

    def add(self, line: int | None, code: str, message: str, param: str | None = None) -> None:
        self.report.error_count += 1
        if len(self.report.errors) < self.cap:
            self.report.errors.append(LineError(line, code, _bounded(message), param))


def validate_stream(
    stream: BinaryIO,
    endpoint: str | None = None,
    limits: ValidationLimits | None = None,
    reopen: Callable[[], BinaryIO] | None = None,
    signatures: PrefixSignatures | None = None,
    adapters: dict[str, str] | None = None,
    model_ids: array | None = None,
    count_tokens: PromptCounter | None = None,
) -> ValidationReport:
    """Validate a batch file read from ``stream``.

    ``signatures``, if given, collects every valid request's prefix hashes and offset
    (``batch/prefixes.py``) for prefix-aware sharding.

    ``adapters`` (adapter name -> base model, the deployment's LoRA registry) lets lines name
    an adapter of the batch's base model instead of the base; ``model_ids``, if given, gets
    one entry per valid request: 0 for the base, k for the k-th adapter of
    ``report.adapter_counts``.

    ``count_tokens`` (a dry run's, batch/prompt_tokens.py) counts the valid requests' input tokens
    into ``report.input_tokens`` (None when it could not).

    ``endpoint`` is the batch's endpoint; if omitted, the first line's ``url``
    sets it. ``reopen`` returns a fresh stream over the same file; it is used
    only to confirm suspected duplicate ids (a 64-bit hash collision must not
    fail a valid batch) and, without it, suspected duplicates are reported as is.
    """
    limits = limits or ValidationLimits()
    report = ValidationReport(endpoint=endpoint, adapter_bases=dict(adapters or {}))
    err = _Collector(report, limits.max_reported_errors)
    report_error = err.add  # bound once: parse_line takes it for every line
    if endpoint is not None and endpoint not in SUPPORTED_ENDPOINTS:
        err.add(None, ValidationCode.INVALID_ENDPOINT,
                f"endpoint {echo(endpoint)} is not supported; use one of {', '.join(SUPPORTED_ENDPOINTS)}",
                "endpoint")
        return report

    ids = IdHashLog()
    # A run of blank lines waiting for the next request: where it starts and how long it is.
    blank = _BlankRun()
    # A buffered stream lets a run of bare newlines be consumed in chunks, not line by line.
    peek = getattr(stream, "peek", None)
    line_no = 0
    total_bytes = 0
    output_bound = unbounded = 0
    last_had_newline = True
    # Hot loop: one pass per line, so everything it touches is a local.
    max_file_bytes = limits.max_file_bytes
    max_requests = limits.max_requests
    readline = stream.readline
    max_line = limits.max_line_bytes
    limit = max_line + 2  # room for "\r\n" after a line of exactly max_line bytes
    id_hashes, spill_at = ids.hashes, ids.spill_at
    add_hash = id_hashes.append
    add_line = ids.lines.append
    sign = signatures.add if signatures is not None else None
    count = count_tokens.add if count_tokens is not None else None

    while True:
        raw = readline(limit)
        if not raw:
            break
        size = len(raw)
        too_long = False
        if size == limit and raw[-1] != 0x0A:
            too_long = True
            size = skip_rest_of_line(readline, size)
        elif size > max_line and len(raw.rstrip(b"\r\n")) > max_line:
            # Fits the read limit only thanks to the room left for "\r\n": still too long.
            too_long = True
        line_no += 1
        total_bytes += size
        if total_bytes > max_file_bytes:
            err.add(None, ValidationCode.FILE_TOO_LARGE,
                    f"file is larger than the limit of {limits.max_file_bytes} bytes "
                    f"(exceeded at line {line_no}); split it into several batches "
                    "or raise max_file_bytes", "max_file_bytes")
            break
        if too_long:
            blank.flush(err)
            err.add(line_no, ValidationCode.LINE_TOO_LARGE,
                    f"line is {size} bytes, over the limit of {limits.max_line_bytes} bytes; "
                    "shorten the request or raise max_line_bytes")
            report.total_requests += 1
            report.last_request_line = line_no
            continue
        last_had_newline = raw[-1] == 0x0A
        if line_no == 1 and raw.startswith(UTF8_BOM):
            err.add(1, ValidationCode.BOM_NOT_ALLOWED,
                    "file starts with a UTF-8 byte order mark; save it as UTF-8 without BOM")
            raw = raw[len(UTF8_BOM):]
        if raw.endswith(b"\r\n"):
            err.add(line_no, ValidationCode.CRLF_LINE_ENDING,
                    "line ends with CRLF (\\r\\n); use Unix line endings (\\n)")
        if not raw or raw.isspace():  # same as `not raw.strip()`, without copying the line
            blank.add(line_no, 1)
            if raw == b"\n" and peek is not None:
                skipped = skip_newlines(stream, peek)
                if skipped:
                    blank.add(line_no + 1, skipped)
                    line_no += skipped
                    total_bytes += skipped
                    if total_bytes > max_file_bytes:
                        err.add(None, ValidationCode.FILE_TOO_LARGE,
                                f"file is larger than the limit of {limits.max_file_bytes} bytes "
                                f"(exceeded at line {line_no - (total_bytes - max_file_bytes) + 1}); "
                                "split it into several batches or raise max_file_bytes",
                                "max_file_bytes")
                        break
            continue
        if blank.count:
            blank.flush(err)
        report.total_requests += 1
        report.last_request_line = line_no
        if report.total_requests > max_requests:
            err.add(line_no, ValidationCode.TOO_MANY_REQUESTS,
                    f"file has more than {limits.max_requests} requests; split it into several "
                    "batches or raise max_requests", "max_requests")
            break
        record = parse_line(raw, line_no, last_had_newline, report_error)
        if record is None:
            continue
        custom_id = _check_record(record, line_no, report, err)
        if custom_id is not None:
            # The output bound (batch/admission.py), the common case inline: this runs once a line.
            body = record.get("body")
            bound = body.get("max_tokens") if type(body) is dict else None
            if type(bound) is not int or bound < 0:
                bound = output_limit(body)
            if bound is None:
                unbounded += 1
            else:
                output_bound += bound
            add_hash(hash(custom_id))
            add_line(line_no)
            if len(id_hashes) == spill_at:
                ids.spill()
            if sign is not None:
                sign(raw, total_bytes - size)
            if model_ids is not None:
                model_ids.append(_model_id(record, report))
            if count is not None:
                count(line_no, record["url"], body, size)

    report.total_bytes = total_bytes
    report.max_output_tokens, report.unbounded_requests = output_bound, unbounded
    report.input_tokens = count_tokens.total() if count_tokens is not None else None
    if report.total_requests == 0 and report.error_count == 0:
        err.add(None, ValidationCode.EMPTY_FILE, "file holds no requests")
    for line, first, cid in duplicate_ids(ids, reopen, limits.max_line_bytes):
        if cid is None:  # the file cannot be read again: the lines, by the ids' hashes
            err.add(line, ValidationCode.DUPLICATE_CUSTOM_ID,
                    f"custom_id is a duplicate of the one on line {first}", "custom_id")
        else:
            err.add(line, ValidationCode.DUPLICATE_CUSTOM_ID,
                    f"custom_id {echo(cid)} already appears on line {first}; "
                    "custom_id must be unique in a batch", "custom_id")
    return report


class _BlankRun:
    """Consecutive blank lines not yet followed by a request: two integers, whatever the run's length."""

    __slots__ = ("count", "first")

    def __init__(self) -> None:
        self.first = 0
        self.count = 0

    def add(self, line_no: int, n: int) -> None:
        if not self.count:
            self.first = line_no
        self.count += n

    def flush(self, err: _Collector) -> None:
        # Blank lines are fine at the end of a file; before a request they are a mistake,
        # reported once per run.
        if self.count == 1:
            err.add(self.first, ValidationCode.BLANK_LINE, "blank line between requests; remove it")
        elif self.count:
            last = self.first + self.count - 1
            err.add(self.first, ValidationCode.BLANK_LINE,
                    f"{self.count} blank lines (lines {self.first}-{last}) between requests; "
                    "remove them")
        self.count = 0


def _check_record(
    record: Any, line_no: int, report: ValidationReport, err: _Collector
) -> str | None:
    # Fast path for the common, valid line; any doubt falls through to the full checks.
    if type(record) is dict:
        custom_id = record.get("custom_id")
        body = record.get("body")
        if (
            type(custom_id) is str and custom_id
            and report.endpoint is not None and record.get("url") == report.endpoint
            and report.model is not None and type(body) is dict
            and body.get("model") == report.model and record.get("method") == "POST"
        ):
            # One dict lookup for chat/completions/embeddings; the others check their body too.
            check = BODY_CHECKS.get(report.endpoint)
            if check is None or not check(body):
                return custom_id
    if not isinstance(record, dict):
        err.add(line_no, ValidationCode.INVALID_JSON_LINE,
                f"line is a JSON {type(record).__name__}, not an object with "
                "custom_id, method, url and body")
        return None
    custom_id = record.get("custom_id")
    if custom_id is None:
        err.add(line_no, ValidationCode.MISSING_REQUIRED_PARAMETER, "custom_id is missing", "custom_id")
    elif not isinstance(custom_id, str) or not custom_id:
        err.add(line_no, ValidationCode.INVALID_PARAMETER_TYPE, "custom_id must be a non-empty string",
                "custom_id")
        custom_id = None

    method = record.get("method")
    if method is None:
        err.add(line_no, ValidationCode.MISSING_REQUIRED_PARAMETER, "method is missing", "method")
    elif method != "POST":
        err.add(line_no, ValidationCode.INVALID_METHOD, f"method is {echo(method)}; only 'POST' is supported",
                "method")

    url = record.get("url")
    if url is None:
        err.add(line_no, ValidationCode.MISSING_REQUIRED_PARAMETER, "url is missing", "url")
    elif url not in SUPPORTED_ENDPOINTS:
        hint = (f"use {VLLM_ALIASES[url]} (vLLM serves {url} too, but a batch names the /v1 endpoint)"
                if isinstance(url, str) and url in VLLM_ALIASES
                else f"use one of {', '.join(SUPPORTED_ENDPOINTS)}")
        err.add(line_no, ValidationCode.INVALID_URL, f"url {echo(url)} is not supported; {hint}", "url")
        url = None
    elif report.endpoint is None:
        report.endpoint = url
    elif url != report.endpoint:
        err.add(line_no, ValidationCode.MISMATCHED_ENDPOINT,
                f"url {echo(url)} differs from the batch endpoint {echo(report.endpoint)}; "
                "a batch targets one endpoint", "url")

    body = record.get("body")
    if body is None:
        err.add(line_no, ValidationCode.MISSING_REQUIRED_PARAMETER, "body is missing", "body")
        return custom_id
    if not isinstance(body, dict):
        err.add(line_no, ValidationCode.INVALID_PARAMETER_TYPE, "body must be a JSON object", "body")
        return custom_id
    model = body.get("model")
    if not isinstance(model, str) or not model:
        err.add(line_no, ValidationCode.MISSING_MODEL, "body.model must be a non-empty string", "body.model")
    else:
        _check_model(model, line_no, report, err)
    # The body is checked against the line's own endpoint (a mismatch is reported above).
    check = BODY_CHECKS.get(url) if isinstance(url, str) else None
    if check is not None:
        for code, message, param in check(body):
            err.add(line_no, code, message, param)
    return custom_id


def _check_model(model: str, line_no: int, report: ValidationReport, err: _Collector) -> None:
    """One base model per batch; with the deployment's adapters, lines may also name adapters of it."""
    base_of = report.adapter_bases.get(model)
    if report.model is None:
        report.model = base_of or model
    if model == report.model:
        return
    if base_of is not None and base_of == report.model:
        count = report.adapter_counts.get(model, 0)
        if not count:
            report.adapter_ids[model] = len(report.adapter_ids) + 1
        report.adapter_counts[model] = count + 1
        return
    if not report.adapter_bases:
        err.add(line_no, ValidationCode.MISMATCHED_MODEL,
                f"body.model {echo(model)} differs from {echo(report.model)} (first seen earlier); "
                "a batch uses one model", "body.model")
    elif base_of is not None:
        err.add(line_no, ValidationCode.MISMATCHED_MODEL,
                f"body.model {echo(model)} is an adapter of {echo(base_of)}, but this batch's base model "
                f"is {echo(report.model)} (first seen earlier); a batch uses one base model and its "
                "adapters", "body.model")
    else:
        known = sorted(a for a, b in report.adapter_bases.items() if b == report.model)
        listed = f"its adapters are {', '.join(known[:20])}" if known else "it has no adapters"
        err.add(line_no, ValidationCode.UNKNOWN_MODEL,
                f"body.model {echo(model)} is neither the batch's model {echo(report.model)} nor one of "
                f"its LoRA adapters ({listed}); fix body.model, or ask the deployment to list the "
                "adapter", "body.model")


def _model_id(record: Any, report: ValidationReport) -> int:
    """0 for the base model, k for the k-th adapter of ``report.adapter_counts``."""
    body = record.get("body") if type(record) is dict else None
    model = body.get("model") if type(body) is dict else None
    return report.adapter_ids.get(model, 0) if model != report.model else 0
