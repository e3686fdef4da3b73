"""Run one shard: bounded-concurrency asyncio HTTP with retries and checkpoints."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from aibrix_operators.batch.jsonfast import JSONDecodeError, dumps, loads
from aibrix_operators.batch.records import Usage, error_record, success_record
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.progress import ProgressReporter
from aibrix_operators.driver.results import ResultLog
from aibrix_operators.driver.retry import (
    backoff_delay,
    exception_code,
    is_retryable_exception,
    is_retryable_status,
    parse_retry_after,
)
from aibrix_operators.storage import Storage

log = logging.getLogger(__name__)


@dataclass
class ShardOutcome:
    """What one driver run did; it lands in XCom, so only plain types."""

    shard: str
    total: int
    resumed: int = 0  # answered by an earlier, interrupted run
    completed: int = 0
    failed: int = 0
    retries: int = 0
    elapsed_s: float = 0.0
    usage: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Counters:
    def __init__(self) -> None:
        self.completed = 0
        self.failed = 0
        self.retries = 0
        self.usage = Usage()


async def run_shard(
    storage: Storage,
    shard_uri: str,
    results_prefix: str,
    config: DriverConfig,
    total: int | None = None,
    name: str | None = None,
) -> ShardOutcome:
    """Answer every request of the shard exactly once in the result log under ``results_prefix``.

    Requests already in the log (from an interrupted earlier run) are skipped.
    """
    name = name or shard_uri.rsplit("/", 1)[-1]
    started = time.monotonic()
    result_log = ResultLog(storage, results_prefix, config.flush_interval_s, config.flush_every)
    done = await asyncio.to_thread(result_log.done_ids)
    if total is None:
        total = await asyncio.to_thread(_count_lines, storage, shard_uri)
    outcome = ShardOutcome(shard=name, total=total, resumed=len(done))
    if done:
        log.info("%s: resuming, %d of %d requests already answered", name, len(done), total)

    counters = _Counters()
    progress = ProgressReporter(name, total, config.progress_interval_s, already_done=len(done))
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, connect=config.connect_timeout_s)
    connector = aiohttp.TCPConnector(limit=config.concurrency, limit_per_host=config.concurrency)
    headers = config.headers()
    with storage.open_read(shard_uri) as src:
        requests = _pending_requests(src, done)
        async with aiohttp.ClientSession(
            timeout=timeout, connector=connector, headers=headers, json_serialize=None
        ) as session:
            sender = _Sender(session, config, counters)
            stop_flusher = asyncio.Event()
            flusher = asyncio.create_task(_flush_loop(result_log, storage, stop_flusher))
            reporter = asyncio.create_task(progress.run(lambda: (counters.completed, counters.failed)))
            try:
                workers = [
                    asyncio.create_task(_worker(requests, sender, result_log, counters, config))
                    for _ in range(config.concurrency)
                ]
                await asyncio.gather(*workers)
            finally:
                stop_flusher.set()
                await flusher
                reporter.cancel()
    await asyncio.to_thread(result_log.flush)
    progress.report(counters.completed, counters.failed, final=True)

    outcome.completed = counters.completed
    outcome.failed = counters.failed
    outcome.retries = counters.retries
    outcome.elapsed_s = round(time.monotonic() - started, 3)
    outcome.usage = counters.usage.as_dict()
    return outcome


def _count_lines(storage: Storage, uri: str) -> int:
    with storage.open_read(uri) as src:
        return sum(1 for line in src if line.strip())


def _pending_requests(src: Any, done: set[str]) -> Iterator[dict[str, Any]]:
    for raw in src:
        if not raw.strip():
            continue
        record = loads(raw)
        if record["custom_id"] not in done:
            yield record


async def _worker(
    requests: Iterator[dict[str, Any]],
    sender: _Sender,
    result_log: ResultLog,
    counters: _Counters,
    config: DriverConfig,
) -> None:
    # Workers share one iterator; asyncio switches only at awaits, so next() is safe.
    for record in requests:
        if config.deadline is not None and time.time() >= config.deadline:
            line = error_record(
                record["custom_id"], "batch_expired",
                "the batch's completion window ended before this request was sent",
            )
        else:
            line = await sender.send(record)
        if line["error"] is None:
            counters.completed += 1
        else:
            counters.failed += 1
        result_log.append(dumps(line))


async def _flush_loop(result_log: ResultLog, storage: Storage, stop: asyncio.Event) -> None:
    # Writes happen in a thread so a slow disk or S3 never stalls the HTTP loop.
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=min(0.2, result_log.flush_interval_s))
        except TimeoutError:
            pass
        if result_log.due():
            segment = result_log.take_segment()
            if segment is not None:
                await asyncio.to_thread(storage.write_bytes, *segment)


class _Sender:
    def __init__(self, session: aiohttp.ClientSession, config: DriverConfig, counters: _Counters) -> None:
        self.session = session
        self.config = config
        self.counters = counters
        self.base_url = config.base_url

    async def send(self, record: dict[str, Any]) -> dict[str, Any]:
        custom_id = record["custom_id"]
        url = self.base_url + record["url"]
        payload = dumps(record["body"])
        cfg = self.config
        for attempt in range(1, cfg.max_attempts + 1):
            try:
                async with self.session.post(url, data=payload) as resp:
                    status = resp.status
                    raw = await resp.read()
                    request_id = resp.headers.get("x-request-id")
                    retry_after = parse_retry_after(resp.headers.get("retry-after"))
            except Exception as exc:  # noqa: BLE001 - classified just below
                if not is_retryable_exception(exc):
                    return error_record(custom_id, exception_code(exc), _describe(exc, attempt))
                if attempt < cfg.max_attempts:
                    await self._backoff(attempt, None)
                    continue
                return error_record(custom_id, exception_code(exc), _describe(exc, attempt))

            if 200 <= status < 300:
                try:
                    body = loads(raw)
                except JSONDecodeError:
                    return error_record(
                        custom_id, "invalid_response_body",
                        f"server answered {status} with a body that is not JSON: {raw[:200]!r}",
                        status, request_id, raw[:2000].decode("utf-8", "replace"),
                    )
                self.counters.usage.add_response_body(body)
                return success_record(custom_id, status, request_id or _body_id(body), body)
            if is_retryable_status(status) and attempt < cfg.max_attempts:
                await self._backoff(attempt, retry_after)
                continue
            body = _parse_error_body(raw)
            code, message = _error_of(status, body, attempt)
            return error_record(custom_id, code, message, status, request_id, body)
        raise AssertionError("unreachable: the loop always returns")

    async def _backoff(self, attempt: int, retry_after: float | None) -> None:
        self.counters.retries += 1
        cfg = self.config
        await asyncio.sleep(backoff_delay(attempt, cfg.backoff_base_s, cfg.backoff_max_s, retry_after))


def _describe(exc: BaseException, attempts: int) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text} (after {attempts} attempt{'s' * (attempts > 1)})"


def _body_id(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("id"), str):
        return body["id"]
    return f"req-{uuid.uuid4().hex}"


def _parse_error_body(raw: bytes) -> Any:
    try:
        return loads(raw)
    except JSONDecodeError:
        return raw[:2000].decode("utf-8", "replace")


def _error_of(status: int, body: Any, attempts: int) -> tuple[str, str]:
    """OpenAI-style servers put ``{"error": {"code", "message"}}`` in error bodies; use it."""
    detail = body.get("error") if isinstance(body, dict) else None
    if isinstance(detail, dict):
        code = detail.get("code") or detail.get("type") or f"http_{status}"
        message = detail.get("message") or f"HTTP {status}"
    else:
        code, message = f"http_{status}", f"HTTP {status}: {str(body)[:500]}"
    if attempts > 1:
        message = f"{message} (after {attempts} attempts)"
    return str(code), str(message)
