"""Run one shard: bounded-concurrency asyncio HTTP with retries, an outage breaker and checkpoints.

Failure rules (ARCHITECTURE.md §5): a request ends as an error line only for a
reason of its own — a 4xx other than 408/429, a 5xx or garbled answer that keeps
coming back while the endpoint answers other requests, or the batch's deadline.
An endpoint outage pauses the shard (``health.EndpointOutage`` past the budget)
and a store that will not take checkpoints fails it
(``checkpoint.CheckpointWriteFailed``); either way the unanswered requests are
not recorded, so a retry of the task sends them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from aibrix_operators.batch.error_codes import UNANSWERED as UNANSWERED_CODES
from aibrix_operators.batch.error_codes import RequestError
from aibrix_operators.batch.grouped_split import lines_uri
from aibrix_operators.batch.jsonfast import dumps, loads
from aibrix_operators.batch.prefixes import prefix_hashes
from aibrix_operators.batch.records import Usage, error_record
from aibrix_operators.batch.shard_results import ResultLog, fingerprint_shard
from aibrix_operators.batch.stop_rules import StopTally
from aibrix_operators.capacity import controller as shared_capacity
from aibrix_operators.capacity.controller import EndpointController, ShardDemand
from aibrix_operators.capacity.limiter import AdaptiveLimiter
from aibrix_operators.driver.answers import (
    Failure,
    classify,
    expired_line,
    stopped_line,
    transport_failure,
)
from aibrix_operators.driver.cache_salt import salted_body
from aibrix_operators.driver.cancel import CancelWatch
from aibrix_operators.driver.checkpoint import CheckpointWriteFailed, CheckpointWriter
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.engine_time import endpoint_tokens, engine_seconds
from aibrix_operators.driver.health import EndpointHealth
from aibrix_operators.driver.metrics import COLLECTOR as METRICS
from aibrix_operators.driver.metrics import LatencyBuckets, push_from_env, serve_from_env
from aibrix_operators.driver.preflight import probe_endpoint
from aibrix_operators.driver.priority import DEDICATED_PRIORITY, prioritized_body
from aibrix_operators.driver.progress import ProgressReporter
from aibrix_operators.driver.retry import backoff_delay
from aibrix_operators.driver.shard_outcome import ShardChanged, ShardOutcome
from aibrix_operators.driver.stop_watch import StopWatch, shard_stop_watch
from aibrix_operators.driver.warmup import DEFAULT_WAIT_S, WarmupGate
from aibrix_operators.storage import Storage

log = logging.getLogger(__name__)

# Answers that say the endpoint (or the router shedding batch first) has no room: shared mode's
# limit halves on them.
SHED_STATUS = frozenset({429, 503})


def _capacity_detail(counters: _Counters) -> str:  # shared mode's limit, on progress lines
    return "" if counters.capacity is None else " " + counters.capacity.describe()


class _Counters:
    def __init__(self) -> None:
        self.completed = 0
        self.failed = 0
        self.unanswered = 0  # of failed: left unanswered by a stop, a cancel or the deadline
        self.retries = 0
        self.usage = Usage()
        # Read by driver/metrics.py at scrape time (nothing per request but the histogram).
        self.started = 0
        self.latency = LatencyBuckets()
        self.health: EndpointHealth | None = None
        self.capacity: EndpointController | None = None  # shared mode's controller
        self.demand: ShardDemand | None = None
        self.progress: ProgressReporter | None = None  # its at_risk is a metric


async def run_shard(
    storage: Storage,
    shard_uri: str,
    results_prefix: str,
    config: DriverConfig,
    total: int | None = None,
    name: str | None = None,
    warm_up: bool = False,
    warmup_wait_s: float = DEFAULT_WAIT_S,
) -> ShardOutcome:
    """Answer every request of the shard exactly once in the result log under ``results_prefix``.

    Requests already in the log (from an interrupted earlier run) are skipped. ``warm_up``
    holds each prefix group's followers until its first request is answered (at most
    ``warmup_wait_s``; driver/warmup.py), in a shard split in prefix order (one with a ``.lines``
    file). Off by default: against vLLM it measured slower than sending the group at once
    (docs/prefix-batching.md, section 5).
    """
    name = name or shard_uri.rsplit("/", 1)[-1]
    started = time.monotonic()
    fingerprint = await asyncio.to_thread(fingerprint_shard, storage, shard_uri)
    if total is not None and total != fingerprint.requests:
        raise ShardChanged(
            f"{shard_uri} holds {fingerprint.requests} requests but {name} was planned with {total}; "
            "the shard was rewritten after this task was planned: clear the split task too"
        )
    total = fingerprint.requests
    result_log = ResultLog(
        storage, results_prefix, fingerprint.binding, config.flush_interval_s, config.flush_every
    )
    done, done_failed = await asyncio.to_thread(result_log.scan)
    if warm_up:
        warm_up = await asyncio.to_thread(storage.exists, lines_uri(shard_uri))
    outcome = ShardOutcome(shard=name, total=total, resumed=len(done), resumed_failed=done_failed,
                           attempt_id=result_log.attempt_id)
    if done:
        log.info("%s: resuming, %d of %d requests already answered", name, len(done), total)

    counters = _Counters()
    serve_from_env()
    METRICS.track(counters)
    progress = ProgressReporter(name, total, config.progress_interval_s, already_done=len(done),
                                deadline=config.deadline, detail=lambda: _capacity_detail(counters))
    counters.progress = progress
    writer = CheckpointWriter(
        result_log, retry_timeout_s=config.checkpoint_retry_s,
        max_unflushed=max(config.max_unflushed, config.concurrency),
    )
    try:
        if config.capacity is not None:
            counters.capacity, counters.demand = shared_capacity.join(
                config.base_url, config.capacity, config.concurrency, config.headers(), config.deadline,
                total - len(done))
        cancel = CancelWatch(storage, config.cancel_uri, config.cancel_poll_s)
        stop = shard_stop_watch(storage, config, name, cancel, len(done), done_failed, lambda: StopTally(
            counters.completed + counters.failed, counters.failed - counters.unanswered,
            counters.usage.input_tokens, counters.usage.output_tokens))
        with storage.open_read(shard_uri) as src:
            if warm_up:
                gate = WarmupGate(_pending_with_prefixes(src, done), warmup_wait_s)
                await _send_all(gate, config, counters, writer, progress, outcome, cancel, stop)
                log.info("%s: prefix warm-up held %d requests behind their group's first answer "
                         "(%d groups released by the %.0f s bound)", name, gate.held, gate.timed_out,
                         warmup_wait_s)  # fmt: skip
            else:
                await _send_all(_pending_requests(src, done), config, counters, writer, progress, outcome,
                                cancel, stop)  # fmt: skip
        if stop is not None:
            await asyncio.to_thread(stop.publish, True)
    finally:
        outcome.completed = counters.completed
        outcome.failed = counters.failed
        outcome.retries = counters.retries
        outcome.elapsed_s = round(time.monotonic() - started, 3)
        outcome.usage = counters.usage.as_dict()
        outcome.checkpoint_write_retries = writer.write_retries
        progress.report(counters.completed, counters.failed, final=True)
        if counters.capacity is not None and counters.demand is not None:
            await shared_capacity.leave(counters.capacity, counters.demand)
        METRICS.finish(counters)
        await asyncio.to_thread(push_from_env)
    return outcome


async def _send_all(
    requests: Iterator[dict[str, Any]] | WarmupGate,
    config: DriverConfig,
    counters: _Counters,
    writer: CheckpointWriter,
    progress: ProgressReporter,
    outcome: ShardOutcome,
    cancel: CancelWatch,
    stop: StopWatch | None = None,
) -> None:
    """Workers, checkpoint writer, breaker probe, cancel watch and progress in one task group: the first
    failure cancels the rest, and the sessions close once."""
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, connect=config.connect_timeout_s)
    connector = aiohttp.TCPConnector(limit=config.concurrency, limit_per_host=config.concurrency)
    headers = config.headers()
    async with (
        aiohttp.ClientSession(
            timeout=timeout, connector=connector, headers=headers, json_serialize=None
        ) as session,
        aiohttp.ClientSession(headers=headers) as probe_session,  # never queues behind requests
    ):
        health = EndpointHealth(lambda: probe_endpoint(probe_session, config, health.canary), config)
        counters.health = health
        sender = _Sender(session, config, counters, health, cancel)
        # Before any worker starts: a cancel that came before the shard did must stop every request
        # (the watch below only polls, and the workers would send `concurrency` requests first).
        await cancel.check()
        if stop is not None and (reason := await asyncio.to_thread(stop.check)) is not None:
            cancel.stop(reason)  # a batch another shard stopped sends nothing more from this one
        served_before, sending_since = await endpoint_tokens(probe_session, config.base_url), time.monotonic()
        try:
            async with asyncio.TaskGroup() as tg:
                write_task = tg.create_task(writer.run())
                probe_task = tg.create_task(health.run())
                cancel_task = tg.create_task(cancel.run())
                stop_task = tg.create_task(stop.run()) if stop is not None else None
                report_task = tg.create_task(
                    progress.run(lambda: (counters.completed, counters.failed))
                )
                work = _gated_worker if isinstance(requests, WarmupGate) else _worker
                workers = [
                    tg.create_task(work(requests, sender, writer, counters))  # type: ignore[arg-type]
                    for _ in range(config.concurrency)
                ]
                await asyncio.wait(workers)
                writer.close()
                probe_task.cancel()
                cancel_task.cancel()
                if stop_task is not None:
                    stop_task.cancel()
                report_task.cancel()
                await write_task
            outcome.engine_s = engine_seconds(  # driver/engine_time.py: its share of the endpoint's time
                served_before, await endpoint_tokens(probe_session, config.base_url),
                counters.usage.input_tokens + counters.usage.output_tokens, time.monotonic() - sending_since)
        except BaseExceptionGroup as group:
            cause = _first_cause(group)
            if not isinstance(cause, CheckpointWriteFailed):
                await writer.flush_what_is_left()
            raise cause from None
        finally:
            outcome.outages = health.outages
            outcome.paused_s = round(health.paused_s, 3)
            outcome.cancelled = cancel.cancelled and cancel.stopped_by is None
            outcome.stopped_by = cancel.stopped_by.rule if cancel.stopped_by is not None else None


def _first_cause(group: BaseExceptionGroup) -> BaseException:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_cause(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]


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
    writer: CheckpointWriter,
    counters: _Counters,
) -> None:
    # Workers share one iterator; asyncio switches only at awaits, so next() is safe.
    result_log = writer.log
    limit = writer.max_unflushed
    clock, observe = time.monotonic, counters.latency.observe
    for record in requests:
        if result_log.buffered() >= limit:  # the store is behind: wait for it (rare)
            await writer.wait_for_room()
        counters.started += 1
        sent = clock()
        line = await sender.send(record)
        observe(clock() - sent)
        _keep_answer(record, line, counters, result_log)


def _keep_answer(record: dict[str, Any], line: dict[str, Any], counters: _Counters, result_log: Any) -> None:
    """Count a request's output line and buffer it for the checkpoint writer."""
    if (demand := counters.demand) is not None:  # shared mode: what the shard has left, for urgency
        demand.done += 1
        demand.remaining -= 1
    try:
        data = dumps(line)
    except TypeError as exc:  # a body orjson cannot write back: the request still gets a line
        line = error_record(record["custom_id"], RequestError.INVALID_RESPONSE_BODY,
                            f"the server's answer cannot be stored as JSON: {exc}")
        data = dumps(line)
    if line["error"] is None:
        counters.completed += 1
    else:
        counters.failed += 1
        if line["error"]["code"] in UNANSWERED_CODES:
            counters.unanswered += 1
    result_log.append(data)


def _pending_with_prefixes(src: Any, done: set[str]) -> Iterator[tuple[dict[str, Any], tuple[int, ...]]]:
    for raw in src:
        if not raw.strip():
            continue
        record = loads(raw)
        if record["custom_id"] not in done:
            yield record, prefix_hashes(raw)


async def _gated_worker(
    gate: WarmupGate,
    sender: _Sender,
    writer: CheckpointWriter,
    counters: _Counters,
) -> None:
    """``_worker`` for a grouped shard: requests come from the warm-up gate, and a group's
    first answer releases the rest of the group (kept apart so ``_worker`` stays as it is)."""
    result_log = writer.log
    limit = writer.max_unflushed
    clock, observe = time.monotonic, counters.latency.observe
    while (item := await gate.next()) is not None:
        record, leader = item
        if result_log.buffered() >= limit:
            await writer.wait_for_room()
        counters.started += 1
        sent = clock()
        line = await sender.send(record)
        observe(clock() - sent)
        gate.answered(leader)
        _keep_answer(record, line, counters, result_log)


@dataclass(eq=False)
class _Sender:
    session: aiohttp.ClientSession
    config: DriverConfig
    counters: _Counters
    health: EndpointHealth
    cancel: CancelWatch
    # Derived from the above once, for the per-request path.
    base_url: str = field(init=False)
    # Shared mode: the endpoint's limiter (shared by every shard sending there) and priority.
    capacity: EndpointController | None = field(init=False)
    limiter: AdaptiveLimiter | None = field(init=False)
    priority: int = field(init=False)  # never the line's own (priority.py)
    deadline_key: float = field(init=False)

    def __post_init__(self) -> None:
        config = self.config
        self.base_url = config.base_url
        self.capacity = self.counters.capacity
        self.limiter = self.capacity.limiter if self.capacity is not None else None
        self.priority = config.capacity.batch_priority if config.capacity is not None else DEDICATED_PRIORITY
        self.deadline_key = config.deadline if config.deadline is not None else float("inf")

    async def send(self, record: dict[str, Any]) -> dict[str, Any]:
        """The request's result line: a success, or an error that belongs to the request."""
        custom_id = record["custom_id"]
        url = self.base_url + record["url"]
        payload = dumps(prioritized_body(salted_body(record["body"], self.config.cache_salt, record["url"]),
                                         self.priority))
        cfg, health, limiter = self.config, self.health, self.limiter
        charged = 0  # failed attempts charged to this request
        attempts = 0
        last: Failure | None = None
        while True:
            # The hot path is two attribute checks; the waits are only for the rare cases.
            if self.cancel.cancelled:
                return self._unanswered(custom_id, last)
            if health.is_open and not await self._wait_for_endpoint():
                return self._unanswered(custom_id, last)
            if cfg.deadline is not None and time.time() >= cfg.deadline:
                return expired_line(custom_id, last)
            if limiter is not None and not limiter.try_acquire() and not await self._wait_for_permit():
                return self._unanswered(custom_id, last)
            attempts += 1
            # The request inline, not in a helper coroutine: this runs once per request. A
            # redirect is the endpoint's answer, never a place to send the body (and the key).
            if limiter is None:
                try:
                    async with self.session.post(url, data=payload, allow_redirects=False) as resp:
                        raw = await resp.read()
                        result = classify(custom_id, resp.status, raw, resp.headers, self.counters.usage)
                except Exception as exc:  # noqa: BLE001 - classified by _transport_failure
                    result = transport_failure(custom_id, exc)
            else:
                result = await self._shared_attempt(custom_id, url, payload)
                if result is None:  # withdrawn for online traffic: send it again, uncharged
                    last = Failure(RequestError.PREEMPTED_FOR_ONLINE, "withdrawn for online traffic",
                                    backpressure=True)
                    self.counters.retries += 1
                    continue
            if isinstance(result, dict):
                health.answered()
                if result["error"] is None:
                    health.canary = (url, payload)
                return result
            last = result
            if self.capacity is not None and result.status in SHED_STATUS:
                self.capacity.note_backpressure()
            if self.capacity is None or not result.backpressure:
                # Shared mode expects 429s (a router shedding batch first): an endpoint that says
                # "not now" is alive, and the controller, not the outage breaker, slows down.
                health.failed(result.code)
            if not result.backpressure:
                charged += 1
                if charged >= cfg.max_attempts:
                    # Its own fault if the endpoint passes its health check now; otherwise the
                    # endpoint is down and nothing is charged. Others' answers meanwhile prove
                    # nothing: requests already running when the endpoint went down (a 503 storm,
                    # a lost connection or model) still finish, and on a loaded machine all of a
                    # request's attempts fit in that moment (clean-clone runs turned outages into
                    # error lines that way, three times).
                    problem = await health.check()
                    if problem is None:
                        return result.as_record(custom_id, attempts)
                    health.open(f"{custom_id} failed {charged} times with {result.code}, and {problem}")
                    charged = 0
                    continue
            self.counters.retries += 1
            delay = backoff_delay(attempts, cfg.backoff_base_s, cfg.backoff_max_s, result.retry_after)
            remaining = self._until_deadline()
            await self._sleep_unless_cancelled(delay if remaining is None else min(delay, remaining))

    def _unanswered(self, custom_id: str, last: Failure | None) -> dict[str, Any]:
        """The line of a request a stop rule, a cancel or the deadline left unanswered."""
        stop = self.cancel.stopped_by
        return stopped_line(custom_id, last, self.cancel.cancelled, stop.rule if stop is not None else None)

    async def _wait_for_endpoint(self) -> bool:
        """Wait while the breaker is open; ``False`` when the deadline or a cancel came first."""
        waiter = asyncio.ensure_future(self.health.wait_closed(self._until_deadline()))
        cancelled = asyncio.ensure_future(self.cancel.requested.wait())
        try:
            await asyncio.wait((waiter, cancelled), return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancelled.cancel()
            waiter.cancel()
        return waiter.done() and not waiter.cancelled() and waiter.result() and not self.cancel.cancelled

    async def _shared_attempt(
        self, custom_id: str, url: str, payload: bytes
    ) -> dict[str, Any] | Failure | None:
        """One attempt holding a permit, which the controller can take back (``None``).

        The attempt runs in this worker's own task, which the limiter tracks and may cancel;
        a cancel that was the limiter's alone is taken back (``uncancel``) and the request is
        sent again. (A task per attempt would be simpler to withdraw, and it was: creating and
        awaiting it was most of shared mode's extra CPU per request, bench/RESULTS.md.)"""
        assert self.limiter is not None
        limiter = self.limiter
        task = asyncio.current_task()
        assert task is not None
        limiter.track(task)
        try:
            return await self._post(custom_id, url, payload)
        except asyncio.CancelledError:
            # Withdrawn, and nobody else (a shutdown, a cancelled shard) asked to cancel too.
            if limiter.untrack(task) and task.cancelling() == 1:
                task.uncancel()
                return None
            raise
        finally:
            limiter.untrack(task)
            limiter.release()

    async def _post(self, custom_id: str, url: str, payload: bytes) -> dict[str, Any] | Failure:
        try:
            async with self.session.post(url, data=payload, allow_redirects=False) as resp:
                raw = await resp.read()
                return classify(custom_id, resp.status, raw, resp.headers, self.counters.usage)
        except Exception as exc:  # noqa: BLE001 - classified by _transport_failure
            return transport_failure(custom_id, exc)

    async def _wait_for_permit(self) -> bool:
        """Shared mode, no permit free: queue for one (earliest deadline first); ``False`` when
        the deadline or a cancel came first."""
        assert self.limiter is not None
        permit = asyncio.ensure_future(self.limiter.acquire(self.deadline_key))
        cancelled = asyncio.ensure_future(self.cancel.requested.wait())
        try:
            await asyncio.wait((permit, cancelled), timeout=self._until_deadline(),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancelled.cancel()
        if permit.done() and not permit.cancelled() and permit.exception() is None:
            if not self.cancel.cancelled:
                return True
            self.limiter.release()
            return False
        permit.cancel()  # the limiter hands a permit granted meanwhile on to the next waiter
        try:
            await permit
        except asyncio.CancelledError:
            pass
        return False

    async def _sleep_unless_cancelled(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.cancel.requested.wait(), seconds)
        except TimeoutError:
            pass

    def _until_deadline(self) -> float | None:
        if self.config.deadline is None:
            return None
        return max(self.config.deadline - time.time(), 0.0)
