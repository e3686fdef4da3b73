"""``BatchClient``: AIBrix's Python client, as a thin layer over the official ``openai`` SDK.

Every call is the SDK's own (``files.create``, ``batches.create/retrieve/list/cancel``,
``files.content``), so what works with ``openai.OpenAI`` works here, and ``client.openai``
is that SDK client for anything this layer does not wrap. What it adds: an upload streamed
from a path with progress, the endpoint taken from the file's first line, ``wait`` with a
progress callback, and results streamed line by line (or straight to a file).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import openai
from openai.types import Batch, FileObject

from aibrix_operators.batch.error_codes import ValidationCode
from aibrix_operators.batch.job_pool import JobPool, JobPoolError, load_pool_file, read_pool_file
from aibrix_operators.batch.records import DEFAULT_COMPLETION_WINDOW
from aibrix_operators.batch.stop_rules import StopRules
from aibrix_operators.batch_api import extensions
from aibrix_operators.client.errors import BatchNotDone, InputFileError, PoolConfigError, StopRulesError
from aibrix_operators.client.profile import normalize_base_url
from aibrix_operators.client.progress import ProgressReader

TERMINAL = ("completed", "failed", "expired", "cancelled")
MIN_POLL_S = 1.0  # never poll one batch more often: each poll costs the api-server a snapshot
FIRST_LINE_MAX = 8 << 20  # how much of the first line the local check reads at most


class BatchClient:
    """``BatchClient(endpoint="http://airflow:8080", api_key="sk-…")``.

    ``endpoint`` is the Batch API's base URL; with no path, ``/openai/v1`` (where the Airflow
    plugin mounts it) is added. Extra keyword arguments go to ``openai.OpenAI``.
    """

    def __init__(self, endpoint: str, api_key: str, *, timeout: float = 60.0, max_retries: int = 2,
                 **openai_kwargs: Any) -> None:
        self.base_url = normalize_base_url(endpoint)
        self.openai = openai.OpenAI(base_url=self.base_url, api_key=api_key, timeout=timeout,
                                    max_retries=max_retries, **openai_kwargs)

    # ------------------------------------------------------------------ submit
    def upload(self, input_file: str | os.PathLike[str] | IO[bytes],
               on_progress: Callable[[int, int | None], None] | None = None) -> FileObject:
        """Upload a batch file, streamed from disk (the SDK would read a *path* whole)."""
        if not isinstance(input_file, str | os.PathLike):
            return self.openai.files.create(file=input_file, purpose="batch")
        path = Path(input_file)
        size = path.stat().st_size
        with open(path, "rb") as raw:
            reader = ProgressReader(raw, (lambda done: on_progress(done, size)) if on_progress else _nothing)
            return self.openai.files.create(file=(path.name, reader), purpose="batch")

    def create_batch(self, input_file: str | os.PathLike[str] | IO[bytes] | None = None, *,
                     input_file_id: str | None = None, completion_window: str = DEFAULT_COMPLETION_WINDOW,
                     metadata: dict[str, str] | None = None, endpoint: str | None = None,
                     idempotency_key: str | None = None,
                     pool: JobPool | Mapping[str, Any] | str | os.PathLike[str] | None = None,
                     stop_rules: StopRules | Mapping[str, Any] | None = None,
                     on_upload: Callable[[int, int | None], None] | None = None) -> Batch:
        """Upload ``input_file`` (or use ``input_file_id``) and create its batch.

        ``endpoint`` defaults to the ``url`` of the file's first line. ``pool`` is the job pool:
        a pool file's path, its ``pool:`` mapping, or a ``JobPool`` (docs/job-pool.md); checked
        before the upload, sent as the API's ``pool`` field. The returned Batch keeps the API's
        extra fields: ``batch.monitor_url`` is the run's page in the Airflow UI. ``stop_rules``:
        ``max_error_rate``, ``error_rate_min_sample``, ``max_total_tokens`` (docs/stop-rules.md),
        checked before the upload, sent as the API's ``stop_rules`` field; a pool file's
        ``stop_rules:`` apply too, a rule given here over the file's.
        """
        pool_body = pool_request(pool)
        rules_body = stop_rules_request(with_pool_file_rules(pool, stop_rules))
        if (input_file is None) == (input_file_id is None):
            raise InputFileError("give exactly one of input_file and input_file_id")
        if input_file is not None:
            if isinstance(input_file, str | os.PathLike):
                given = endpoint
                if endpoint is None:
                    endpoint = first_line_endpoint(Path(input_file))
                # Every line, before any byte is sent: a bad file is refused here (exit 2)
                # instead of uploaded and failed by the server's validation seconds later.
                check_input_file(input_file, given)
            input_file_id = self.upload(input_file, on_upload).id
        if endpoint is None:
            raise InputFileError("endpoint is required with input_file_id or a file object "
                                 "(e.g. /v1/chat/completions)")
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        assert input_file_id is not None
        return self.openai.batches.create(
            input_file_id=input_file_id, endpoint=endpoint,  # type: ignore[arg-type]
            completion_window=completion_window,  # type: ignore[arg-type]
            metadata=metadata, extra_headers=headers,
            extra_body={k: v for k, v in (("pool", pool_body), ("stop_rules", rules_body)) if v} or None,
        )

    def dry_run(
        self, input_file: str | os.PathLike[str], *, completion_window: str = DEFAULT_COMPLETION_WINDOW,
        endpoint: str | None = None,
    ) -> dict[str, Any]:
        """Check the file as ``create_batch`` does, then ask the deployment when a batch of that much
        work would be done and what it would cost (``POST /v1/batches/estimate``): nothing is
        uploaded, created or sent to a model. The answer's ``work`` is what this client counted."""
        report = checked_report(input_file, endpoint)
        body = {"model": report.model, "endpoint": report.endpoint, "completion_window": completion_window,
                "work": asdict(report.work())}
        return self.openai.post("/batches/estimate", body=body, cast_to=object)  # type: ignore[return-value]

    # ------------------------------------------------------------------ follow
    def retrieve(self, batch_id: str) -> Batch:
        return self.openai.batches.retrieve(batch_id)

    def list(self, limit: int = 20, all: bool = False) -> Iterator[Batch]:  # noqa: A002 - the CLI's flag
        """Newest first; ``all`` walks every page (``limit`` is then the page size)."""
        page = self.openai.batches.list(limit=limit)
        if all:
            yield from page  # the SDK's auto-pagination fetches the next page as needed
        else:
            yield from page.data

    def cancel(self, batch_id: str) -> Batch:
        return self.openai.batches.cancel(batch_id)

    def wait(self, batch_id: str, on_progress: Callable[[Batch], None] | None = None, poll_s: float = 5.0,
             timeout_s: float | None = None, sleep: Callable[[float], None] = time.sleep) -> Batch:
        """Poll until the batch ends (at most once per second); the final Batch.

        ``on_progress(batch)`` sees every poll's answer. Whatever the final status, it is
        returned, not raised: check ``batch.status``.
        """
        poll_s = max(poll_s, MIN_POLL_S)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            started = time.monotonic()
            batch = self.retrieve(batch_id)
            if on_progress is not None:
                on_progress(batch)
            if batch.status in TERMINAL:
                return batch
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"batch {batch_id} still {batch.status} after {timeout_s:.0f}s")
            # The interval is from poll to poll, not after each answer: a slow answer does not
            # stretch it, and a fast one never makes it shorter than poll_s.
            sleep(max(poll_s - (time.monotonic() - started), 0.0))

    # ------------------------------------------------------------------ results
    def result_file_id(self, batch: Batch | str, errors: bool = False, partial: bool = False) -> str | None:
        """The output (or error) file's id; None when the finished batch has no such lines.
        Raises BatchNotDone when the batch has not finished, or failed as a whole.

        ``partial``: while the batch runs, the file of its finished shards' answers (the API's
        ``aibrix_partial_output_file_id``; None until a shard has finished); once it has ended,
        its output file as without ``partial``."""
        if isinstance(batch, str):
            batch = self.retrieve(batch)
        if partial and errors:
            raise ValueError("partial results are answers only; error lines come with the final errors file")
        if partial and batch.status not in TERMINAL:
            return (batch.model_extra or {}).get(extensions.PARTIAL_OUTPUT_FILE_ID)
        if batch.status not in TERMINAL:
            raise BatchNotDone(f"batch {batch.id} is {batch.status}; results come once it ends: "
                               f"aibrix-batch status {batch.id} --watch", batch)
        file_id = batch.error_file_id if errors else batch.output_file_id
        if file_id is None and batch.status == "failed":
            raise BatchNotDone(f"batch {batch.id} failed{_first_error(batch)}; it has no results", batch)
        return file_id

    def result_chunks(self, batch: Batch | str, errors: bool = False,
                      chunk_size: int | None = None, partial: bool = False) -> Iterator[bytes]:
        """The output (or error) file as raw chunks, as they arrive: never held whole.

        No ``chunk_size`` by default: the pieces httpx reads (64 KiB) are passed on as they
        are; re-chunking them to 1 MiB copied every byte once more (146 vs 257 MB/s measured
        against tests/client/batch_api_stub.py)."""
        file_id = self.result_file_id(batch, errors, partial)
        if file_id is None:
            return
        with self.openai.files.with_streaming_response.content(file_id) as response:
            yield from response.iter_bytes(chunk_size)

    def results(self, batch: Batch | str, errors: bool = False,
                partial: bool = False) -> Iterator[dict[str, Any]]:
        """One dict per result line, streamed (OpenAI's batch output line shape). ``partial``: the
        answers of the shards finished so far, while the batch runs (``result_file_id``)."""
        rest = b""
        for chunk in self.result_chunks(batch, errors, partial=partial):
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            for line in lines:
                if line.strip():
                    yield json.loads(line)
        if rest.strip():
            yield json.loads(rest)

    def download(self, batch: Batch | str, path: str | os.PathLike[str], errors: bool = False,
                 on_progress: Callable[[int], None] | None = None, partial: bool = False) -> int:
        """Write the output (or error) file to ``path`` chunk by chunk; the bytes written.

        Written to a part file of its own next to ``path`` (a random name, created exclusively:
        never through a link someone left at a predictable name) and renamed onto ``path``
        only when complete, so a broken download never looks finished; a failed one leaves
        no part file behind."""
        target = Path(path)
        fd, part = create_part_file(target)
        written = 0
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in self.result_chunks(batch, errors, partial=partial):
                    out.write(chunk)
                    written += len(chunk)
                    if on_progress is not None:
                        on_progress(written)
            os.replace(part, target)
        except BaseException:
            try:
                os.unlink(part)
            except FileNotFoundError:
                pass
            raise
        return written


def create_part_file(target: Path) -> tuple[int, Path]:
    """A new, empty file in ``target``'s folder for a download to ``target``: (fd, path).

    O_CREAT|O_EXCL fails on anything already at the name, a symbolic link included (dangling
    or not), and O_NOFOLLOW says so twice; the name is random, so no one can lay a link in
    its way beforehand. Mode 0o666 less the umask: what ``open(target, "wb")`` would give."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    for _ in range(16):
        part = target.with_name(f"{target.name}.{secrets.token_hex(8)}.part")
        try:
            return os.open(part, flags, 0o666), part
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot create a part file next to {target}: 16 random names were taken")


def pool_request(pool: JobPool | Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """The ``pool`` field of a create request (only the keys set), or None; PoolConfigError for a
    pool of the wrong shape, found here rather than by the server after an upload."""
    if pool is None:
        return None
    try:
        if isinstance(pool, str | os.PathLike):
            pool = load_pool_file(pool)
        elif not isinstance(pool, JobPool):
            pool = JobPool.from_mapping(pool)
    except JobPoolError as exc:
        raise PoolConfigError(str(exc)) from None
    return pool.as_params() or None


def with_pool_file_rules(
    pool: Any, rules: StopRules | Mapping[str, Any] | None
) -> StopRules | Mapping[str, Any] | None:
    """``rules`` over the ``stop_rules:`` of the pool file ``pool`` names (if it is a path): a rule
    given in ``rules`` wins; a complete ``StopRules`` is taken as it is."""
    if not isinstance(pool, str | os.PathLike) or isinstance(rules, StopRules):
        return rules
    try:
        from_file = read_pool_file(pool).get("stop_rules")
    except JobPoolError as exc:
        raise PoolConfigError(str(exc)) from None
    if from_file is None:
        return rules
    try:
        StopRules.from_dict(from_file)  # what is wrong, said with the file's name
    except (ValueError, TypeError) as exc:
        raise StopRulesError(f"pool file {pool}: stop_rules: {exc}") from None
    return {**from_file, **(rules or {})}


def stop_rules_request(rules: StopRules | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The ``stop_rules`` field of a create request, or None for no rule; StopRulesError for a rule
    out of range, found here rather than by the server after an upload."""
    if rules is None:
        return None
    try:
        checked = rules if isinstance(rules, StopRules) else StopRules.from_dict(dict(rules))
    except (ValueError, TypeError) as exc:
        raise StopRulesError(str(exc)) from None
    return checked.as_dict() if checked.active else None


@contextmanager
def _open_batch_file(path: Path) -> Iterator[IO[bytes]]:
    """The batch file opened for reading; what stops that is an InputFileError saying what to do."""
    try:
        f = open(path, "rb")
    except IsADirectoryError:
        raise InputFileError(f"{path} is a directory; give a .jsonl batch file") from None
    except FileNotFoundError:
        raise InputFileError(f"{path} does not exist; give a .jsonl batch file") from None
    except PermissionError:
        raise InputFileError(f"cannot read {path}: permission denied") from None
    with f:
        yield f


def first_line_endpoint(path: Path) -> str:
    """The ``url`` of the file's first request, checked locally before any byte is sent, so
    a file that is no batch at all is refused at once (the server validates every line)."""
    with _open_batch_file(path) as f:
        first = b""
        while not first.strip():
            first = f.readline(FIRST_LINE_MAX)
            if not first:
                raise InputFileError(f"{path} is empty; a batch file has one JSON request per line")
    hint = ('each line must be a request like {"custom_id": "1", "method": "POST", '
            '"url": "/v1/chat/completions", "body": {…}}')
    try:
        request = json.loads(first)
    except (ValueError, UnicodeDecodeError):
        raise InputFileError(f"{path} line 1 is not JSON; {hint}") from None
    if not isinstance(request, dict) or not isinstance(request.get("url"), str):
        raise InputFileError(f"{path} line 1 has no \"url\"; {hint}")
    return request["url"]


# Rules the deployment sets (its size limits, its LoRA adapters, which let lines name another
# model): the local check cannot know them, so it leaves them to the server's validation.
DEPLOYMENT_RULES = frozenset({ValidationCode.FILE_TOO_LARGE, ValidationCode.LINE_TOO_LARGE,
                              ValidationCode.TOO_MANY_REQUESTS, ValidationCode.MISMATCHED_MODEL,
                              ValidationCode.UNKNOWN_MODEL})
# How to fix what the validator's message does not already say how to fix.
FIXES = {
    ValidationCode.MISSING_REQUIRED_PARAMETER: 'add it: each line is {"custom_id": "…", "method": "POST", '
                                               '"url": "/v1/chat/completions", "body": {…}}',
    ValidationCode.INVALID_JSON_LINE: "make the line one JSON object (JSON Lines: one request per line, "
                                      "no line break inside a request)",
    ValidationCode.DUPLICATE_CUSTOM_ID: "give each request its own custom_id",
    ValidationCode.EMPTY_FILE: "put one JSON request on each line",
}
SHOWN_ERRORS = 20  # listed in the error message; the rest are counted


def check_input_file(path: str | os.PathLike[str], endpoint: str | None = None) -> int:
    """Check every line of a batch file as the server will, before it is uploaded; the number
    of requests (``checked_report``'s)."""
    return checked_report(path, endpoint).total_requests


def checked_report(path: str | os.PathLike[str], endpoint: str | None = None) -> Any:
    """Every line of a batch file checked as the server will: the validation report (requests,
    bytes, the output bound: what a dry run sends for an estimate). Raises InputFileError listing
    the bad lines (line number, what, how to fix).

    The server's own validator (``batch/validation.py``, no Airflow), streamed: the file is
    read line by line and never held; what grows with it is 16 bytes per request (the id
    hashes that find duplicate custom_ids). Rules that depend on the deployment
    (``DEPLOYMENT_RULES``) are left to the server. ``endpoint``: the batch's, when given
    (else each line's url must be one the API serves, and all the same)."""
    from aibrix_operators.batch.records import DEFAULT_MAX_LINE_BYTES
    from aibrix_operators.batch.validation import ValidationLimits, validate_stream

    path = Path(path)
    # No size or count limit here (the deployment's are not known); a line over the default
    # limit is skipped unread, so memory stays bounded, and left to the server.
    limits = ValidationLimits(max_requests=2**62, max_file_bytes=2**62, max_line_bytes=DEFAULT_MAX_LINE_BYTES,
                              max_reported_errors=1000)
    with _open_batch_file(path) as stream:
        report = validate_stream(stream, endpoint, limits, reopen=lambda: open(path, "rb"))
    found = [e for e in report.errors if e.code not in DEPLOYMENT_RULES]
    if not found:
        return report
    found.sort(key=lambda e: e.line or 0)
    unlisted = report.error_count - len(report.errors)
    lines = [f"{path} is not a valid batch file, so nothing was uploaded; fix "
             f"{'this' if len(found) == 1 and not unlisted else 'these'} and run again:"]
    for e in found[:SHOWN_ERRORS]:
        where = f"line {e.line}" if e.line else "file"
        param = f" ({e.param})" if e.param and e.param not in e.message else ""
        fix = f"; {FIXES[e.code]}" if e.code in FIXES else ""
        # The JSON parser counts within the one line it was given: "line 1 column 9" means column 9.
        message = re.sub(r"line 1 column (\d+) \(char \d+\)", r"column \1", " ".join(e.message.split()))
        lines.append(f"  {where}: {e.code}{param}: {message}{fix}")
    more = len(found) - SHOWN_ERRORS + unlisted
    if more > 0:
        lines.append(f"  … and {more} more")
    raise InputFileError("\n".join(lines))


def _first_error(batch: Batch) -> str:
    data = batch.errors.data if batch.errors and batch.errors.data else []
    if not data:
        return ""
    e = data[0]
    line = f" at line {e.line}" if e.line else ""
    return f": {e.code}{line}: {' '.join(str(e.message or '').split())[:300]}"


def _nothing(_: int) -> None:
    return None
