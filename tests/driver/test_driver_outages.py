"""Infrastructure faults never become request errors: endpoint outages, failing stores,
overlapping attempts and edited inputs, each with the real component failing."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable

import pytest

from aibrix_operators.batch.job import finalize_batch, split_batch, validate_batch, work_prefix
from aibrix_operators.batch.shard_results import ResultLog, results_prefix, shard_result_log
from aibrix_operators.driver.checkpoint import CheckpointWriteFailed
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.health import EndpointOutage
from aibrix_operators.driver.runner import run_shard
from aibrix_operators.storage import LocalStorage, StorageError
from tests.driver.test_driver_faults import config, one_shard_batch, results_by_id, write_shard

# The test config's per-request retry budget: 3 attempts, backoff base 0.01 s capped at 0.5 s,
# so a request alone would give up after at most 0.01 + 0.02 = 0.03 s of waiting.
RETRY_BUDGET_S = 0.03


class Outage(threading.Thread):
    """Stops the server once the shard has written its first checkpoint and brings it back
    after ``down_s`` — or as soon as ``end()`` is called."""

    def __init__(self, server, prefix_log, down_s: float) -> None:
        super().__init__(daemon=True)
        self.server, self.log, self.down_s = server, prefix_log, down_s
        self._end = threading.Event()
        self.start()

    def run(self) -> None:
        deadline = time.monotonic() + 20
        while not self.log.segments() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.server.down()
        self._end.wait(self.down_s)
        self.server.up()

    def end(self) -> None:
        self._end.set()
        self.join()


def take_down_after_first_result(server, prefix_log, down_s: float) -> Outage:
    return Outage(server, prefix_log, down_s)


def slow_shard(tmp_path, make_request, tag: str, n: int, delay_s: float) -> tuple[str, str]:
    """A shard of ``n`` requests the fault server answers after ``delay_s`` each (ids ``<tag>-0000``
    on), and the results prefix its driver writes under."""
    records = [make_request(f"{tag}-{i:04d}", f"slow:{delay_s}") for i in range(n)]
    return write_shard(tmp_path, records), str(tmp_path / "results")


async def first_checkpoint(log) -> None:
    """Return once the shard has made its first answers durable: the fault lands mid-shard."""
    while not log.segments():
        await asyncio.sleep(0.01)


async def test_outage_longer_than_retry_budget_loses_and_fails_nothing(tmp_path, fault_server, make_request):
    storage = LocalStorage()
    shard, prefix = slow_shard(tmp_path, make_request, "o", 400, 0.01)
    outage_s = 3.0
    assert outage_s > 50 * RETRY_BUDGET_S
    thread = take_down_after_first_result(fault_server, shard_result_log(storage, prefix, shard), outage_s)
    cfg = config(fault_server, concurrency=16, probe_interval_s=0.2)
    outcome = await run_shard(storage, shard, prefix, cfg)
    thread.join()
    results = results_by_id(storage, prefix, shard)
    assert len(results) == 400 and all(r["error"] is None for r in results.values())
    assert (outcome.completed, outcome.failed) == (400, 0)
    assert outcome.outages >= 1 and outcome.paused_s >= outage_s * 0.5
    assert set(fault_server.counts()) == {f"o-{i:04d}" for i in range(400)}


async def test_outage_past_budget_fails_task_then_retry_completes(tmp_path, fault_server, make_request):
    storage = LocalStorage()
    shard, prefix = slow_shard(tmp_path, make_request, "p", 300, 0.01)
    log = shard_result_log(storage, prefix, shard)
    thread = take_down_after_first_result(fault_server, log, 60)  # down for good, for this attempt
    with pytest.raises(EndpointOutage, match="answered no request for .* retrying the task sends them"):
        await run_shard(storage, shard, prefix,
                        config(fault_server, concurrency=16, outage_budget_s=1.5, probe_interval_s=0.2))
    # Nothing unanswered was recorded: every stored line is a success.
    stored = results_by_id(storage, prefix, shard)
    assert 0 < len(stored) < 300 and all(r["error"] is None for r in stored.values())
    thread.end()  # the endpoint is back; Airflow retries the task
    outcome = await run_shard(storage, shard, prefix, config(fault_server, concurrency=16))
    assert (outcome.resumed, outcome.completed, outcome.failed) == (len(stored), 300 - len(stored), 0)
    results = results_by_id(storage, prefix, shard)
    assert len(results) == 300 and all(r["error"] is None for r in results.values())


async def run_into_a_storm(fault_server, storage, shard: str, prefix: str, storm_after: Awaitable[None],
                           outage_budget_s: float) -> None:
    """Run the shard; once ``storm_after`` is done the server answers 503 to everything, and the
    shard must end in EndpointOutage."""

    async def storm() -> None:
        await storm_after
        fault_server.storm = 503

    task = asyncio.create_task(storm())
    with pytest.raises(EndpointOutage):
        await run_shard(storage, shard, prefix, config(fault_server, concurrency=8,
                                                       outage_budget_s=outage_budget_s, probe_interval_s=0.1))
    await task


async def test_503_storm_for_every_request_is_an_outage_not_error_lines(tmp_path, fault_server, make_request):
    # A gateway whose backends are gone: 503 for everything, though the gateway itself is up.
    storage = LocalStorage()
    shard, prefix = slow_shard(tmp_path, make_request, "g", 200, 0.01)
    await run_into_a_storm(fault_server, storage, shard, prefix,
                           first_checkpoint(shard_result_log(storage, prefix, shard)), outage_budget_s=1.5)
    stored = results_by_id(storage, prefix, shard)
    assert 0 < len(stored) < 200 and all(r["error"] is None for r in stored.values())
    fault_server.storm = None
    outcome = await run_shard(storage, shard, prefix, config(fault_server, concurrency=8))
    assert outcome.failed == 0 and len(results_by_id(storage, prefix, shard)) == 200


class FlakyStore(LocalStorage):
    """The local store with writes failing while ``down`` is set (a store outage)."""

    def __init__(self) -> None:
        self.down = threading.Event()
        self.failed_writes = 0

    def write_bytes(self, uri: str, data: bytes) -> None:
        if self.down.is_set():
            self.failed_writes += 1
            raise StorageError(f"cannot write {uri}: store unavailable")
        super().write_bytes(uri, data)

    async def down_after_first_checkpoint(self, log: ResultLog, up_after_s: float | None = None) -> None:
        """The store goes down once the shard's first checkpoint is written to ``log``; back up
        ``up_after_s`` later (None: it stays down)."""
        await first_checkpoint(log)
        self.down.set()
        if up_after_s is not None:
            await asyncio.sleep(up_after_s)
            self.down.clear()


async def test_store_outage_pauses_then_every_answer_is_written(tmp_path, fault_server, make_request):
    store = FlakyStore()
    shard, prefix = slow_shard(tmp_path, make_request, "w", 300, 0.005)
    task = asyncio.create_task(store.down_after_first_checkpoint(shard_result_log(store, prefix, shard), 1.0))
    outcome = await run_shard(store, shard, prefix,
                              config(fault_server, concurrency=8, max_unflushed=20, checkpoint_retry_s=10))
    await task
    assert store.failed_writes > 0 and outcome.checkpoint_write_retries == store.failed_writes
    results = results_by_id(store, prefix, shard)
    assert len(results) == 300 and outcome.completed == 300
    # Back-pressure: with the store down, the shard stopped taking requests at the backlog
    # limit instead of sending the rest into memory.
    assert max(fault_server.counts().values()) == 1


async def test_store_down_past_retry_time_fails_and_retry_completes(tmp_path, fault_server, make_request):
    store = FlakyStore()
    shard, prefix = slow_shard(tmp_path, make_request, "x", 300, 0.005)
    task = asyncio.create_task(store.down_after_first_checkpoint(shard_result_log(store, prefix, shard)))
    started = time.monotonic()
    with pytest.raises(CheckpointWriteFailed, match="will be sent again when the task is retried"):
        await run_shard(store, shard, prefix,
                        config(fault_server, concurrency=8, max_unflushed=20, checkpoint_retry_s=1.0))
    assert time.monotonic() - started < 10  # bounded, not "after the whole shard was sent"
    await task
    sent_before = sum(fault_server.counts().values())
    assert sent_before < 300  # back-pressure stopped sending while nothing could be recorded
    store.down.clear()
    outcome = await run_shard(store, shard, prefix, config(fault_server, concurrency=8))
    results = results_by_id(store, prefix, shard)
    assert len(results) == 300 and outcome.failed == 0
    assert outcome.resumed + outcome.completed == 300


async def test_overlapping_attempts_merge_with_every_id_once(tmp_path, fault_server, make_request):
    storage = LocalStorage()
    records = [make_request(f"z-{i:04d}", "slow:0.01") for i in range(200)]
    batch, work, shard = one_shard_batch(storage, tmp_path, records)
    prefix = results_prefix(work, shard.name)
    # A zombie attempt and its retry, on the same shard and results prefix, at the same time.
    first, second = await asyncio.gather(
        run_shard(storage, shard.uri, prefix, config(fault_server, concurrency=4)),
        run_shard(storage, shard.uri, prefix, config(fault_server, concurrency=4)),
    )
    assert first.completed == second.completed == 200  # both answered everything
    summary, obj = finalize_batch(storage, batch, [shard], work)
    assert obj.request_counts == {"total": 200, "completed": 200, "failed": 0}
    assert summary.duplicates_discarded == 200
    output = (tmp_path / "out" / "output.jsonl").read_bytes().splitlines()
    out_ids = [json.loads(x)["custom_id"] for x in output]
    assert out_ids == [r["custom_id"] for r in records]
    # The kept answer is the earlier attempt's, whichever finished first.
    earlier = min(first.attempt_id, second.attempt_id)
    seg_of = {}
    for seg in shard_result_log(storage, prefix, shard.uri).segments():
        for line in storage.read_bytes(seg).splitlines():
            seg_of.setdefault(json.loads(line)["id"], seg)
    kept = [json.loads(x)["id"] for x in output]
    assert all(earlier in seg_of[i] for i in kept)


async def test_edited_input_never_reuses_old_answers(tmp_path, fault_server, make_request):
    storage = LocalStorage()
    out = str(tmp_path / "out")
    inp = tmp_path / "input.jsonl"

    def submit(version: str):
        recs = [make_request(f"e-{i}") for i in range(20)]
        for r in recs:
            r["body"]["messages"][0]["content"] = f"question {version}"
        inp.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in recs))
        report, batch = validate_batch(storage, str(inp), out)
        assert report.ok
        return batch, split_batch(storage, batch, work, 20, 1 << 30, 1)

    work = work_prefix(out, "run")  # the same run: its tasks cleared after the input was edited
    batch, (shard,) = submit("v1")
    first = await run_shard(storage, shard.uri, results_prefix(work, shard.name), config(fault_server))
    assert first.completed == 20
    batch, (shard,) = submit("v2")
    again = await run_shard(storage, shard.uri, results_prefix(work, shard.name), config(fault_server))
    assert (again.resumed, again.completed) == (0, 20)  # nothing answered for v1 is reused
    summary, obj = finalize_batch(storage, batch, [shard], work)
    assert obj.request_counts["completed"] == 20 and summary.duplicates_discarded == 0
    assert all(n == 2 for n in fault_server.counts().values())


async def test_outage_with_default_settings_the_issue_reproduction(tmp_path, fault_server, make_request):
    # The incident as first measured: default driver settings (5 attempts, backoff 0.5 s doubling
    # to 30 s: a request alone gives up after ~7.5 s of backoff), the endpoint gone early in the
    # shard and back after 10 s. Before the breaker this left dozens of requests as permanent
    # connection_error lines.
    storage = LocalStorage()
    shard, prefix = slow_shard(tmp_path, make_request, "d", 3000, 0.01)
    defaults = DriverConfig(endpoint=fault_server.url, concurrency=16, api_key_env=None)
    assert defaults.backoff_base_s * (2 ** (defaults.max_attempts - 1) - 1) < 10

    thread = take_down_after_first_result(fault_server, shard_result_log(storage, prefix, shard), 10.0)
    outcome = await run_shard(storage, shard, prefix, defaults)
    thread.join()
    assert (outcome.completed, outcome.failed) == (3000, 0)
    assert outcome.outages >= 1
    results = results_by_id(storage, prefix, shard)
    assert len(results) == 3000 and all(r["error"] is None for r in results.values())


async def test_cancel_stops_sending_and_accounts_for_every_request(tmp_path, fault_server, make_request):
    from aibrix_operators.batch.job import request_cancel
    from aibrix_operators.driver.batch_shard import run_shard_of_batch

    storage = LocalStorage()
    records = [make_request(f"k-{i:04d}", "slow:0.02") for i in range(400)]
    batch, work, shard = one_shard_batch(storage, tmp_path, records)
    log = shard_result_log(storage, results_prefix(work, shard.name), shard.uri)

    async def cancel_after_first_checkpoint() -> float:
        await first_checkpoint(log)
        request_cancel(storage, work)
        return time.monotonic()

    canceller = asyncio.create_task(cancel_after_first_checkpoint())
    outcome = await run_shard_of_batch(storage, shard, work, config(fault_server, concurrency=4,
                                                                    cancel_poll_s=0.1))
    cancelled_at = await canceller
    last_sent = max(t for cid in fault_server.counts() for t in fault_server.times(cid))
    assert last_sent - cancelled_at < 1.0  # nothing new went out after the marker was seen
    assert outcome.cancelled and 0 < outcome.completed < 400
    summary, obj = finalize_batch(storage, batch, [shard], work)
    assert obj.status == "cancelled" and obj.cancelled_at and obj.completed_at is None
    counts = obj.request_counts
    assert counts["total"] == 400 and counts["completed"] + counts["failed"] == 400
    assert summary.error_codes == {"batch_cancelled": counts["failed"]}
    assert obj.aibrix_unanswered == counts["failed"]  # what the API shows apart from failures
    assert json.loads((tmp_path / "out" / "batch.json").read_text())["aibrix_unanswered"] == counts["failed"]
    assert counts["completed"] == len(fault_server.counts())  # every request sent was answered


async def test_a_cancel_before_the_shard_starts_sends_nothing(tmp_path, fault_server, make_request):
    # Issue 19, finding 14: the cancel watch started beside the workers, so a shard cancelled
    # before it began still sent up to `concurrency` requests (AIBrix's own API test caught it).
    from aibrix_operators.batch.job import request_cancel
    from aibrix_operators.driver.batch_shard import run_shard_of_batch

    storage = LocalStorage()
    records = [make_request(f"c-{i:03d}") for i in range(30)]
    batch, work, shard = one_shard_batch(storage, tmp_path, records)
    request_cancel(storage, work)
    outcome = await run_shard_of_batch(storage, shard, work, config(fault_server, concurrency=64,
                                                                    cancel_poll_s=5.0))
    assert fault_server.counts() == {}  # not one request went out
    assert outcome.cancelled and (outcome.completed, outcome.failed) == (0, 30)
    summary, obj = finalize_batch(storage, batch, [shard], work)
    assert obj.status == "cancelled" and summary.error_codes == {"batch_cancelled": 30}


async def test_a_request_failing_as_the_endpoint_goes_down_is_an_outage_not_its_error(
    tmp_path, fault_server, make_request
):
    """Request x's attempts are slow 503s; the others are answered through its first two, and
    the endpoint goes down (a storm) during its third. That others were answered meanwhile does
    not make x's failure its own: the health check, failing in the storm, makes it an outage."""
    storage = LocalStorage()
    x = make_request("x", "503@0.3", "503@0.3", "503@0.3", "ok")  # storm replies are not attempts
    records = [x] + [make_request(f"o-{i:03d}", "slow:0.05") for i in range(300)]
    shard = write_shard(tmp_path, records)
    prefix = str(tmp_path / "results")

    async def third_attempt_sent() -> None:
        while fault_server.count("x") < 3:
            await asyncio.sleep(0.005)

    await run_into_a_storm(fault_server, storage, shard, prefix, third_attempt_sent(), outage_budget_s=1.0)
    stored = results_by_id(storage, prefix, shard)
    assert "x" not in stored and [r for r in stored.values() if r["error"]] == []
    fault_server.storm = None
    outcome = await run_shard(storage, shard, prefix, config(fault_server, concurrency=8))
    assert outcome.failed == 0 and results_by_id(storage, prefix, shard)["x"]["error"] is None
