"""A running shard's counts read each result segment once (the Batch API's poll path).

``aibrix-batch status --watch`` polls once a second; before ``ResultTally`` every poll
read every segment written so far (a 5,000-request shard cost the api-server 133 ms of
CPU per poll near its end). These tests count the reads on a real ``LocalStorage``.
"""

from __future__ import annotations

from typing import Any

from aibrix_operators.batch.jsonfast import dumps
from aibrix_operators.batch.lifecycle import RunSnapshot, TaskState
from aibrix_operators.batch.records import error_record, success_record
from aibrix_operators.batch.shard_results import ResultLog, ResultTally, fingerprint_shard, results_prefix
from aibrix_operators.batch.sharding import ShardSpec
from aibrix_operators.batch_api.airflow_runs import BatchRuns
from aibrix_operators.storage import LocalStorage


class CountingStorage(LocalStorage):
    """The real local storage, counting whole-object reads and listings."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        self.listings = 0
        self.listed: list[str] = []  # what each listing returned, all of them

    def read_bytes(self, uri: str) -> bytes:
        self.reads.append(uri)
        return super().read_bytes(uri)

    def list(self, prefix_uri: str, after: str | None = None) -> list[str]:
        self.listings += 1
        found = super().list(prefix_uri, after)
        self.listed.extend(found)
        return found


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _segment(log: ResultLog, *records: dict[str, Any]) -> None:
    for record in records:
        log.append(dumps(record))
    log.flush()


def _ok(cid: str) -> dict[str, Any]:
    # Every answer counts 5 prompt + 3 completion tokens: the batch's live usage sums them.
    return success_record(cid, 200, "r", {"usage": {"prompt_tokens": 5, "completion_tokens": 3}})


def _bad(cid: str) -> dict[str, Any]:
    return error_record(cid, "request_failed", "no")


def test_a_poll_reads_only_the_segments_written_since_the_last(tmp_path) -> None:
    storage = CountingStorage()
    writer = ResultLog(storage, str(tmp_path / "results"), "b1", flush_every=10**6)
    tally = ResultTally(ResultLog(storage, str(tmp_path / "results"), "b1"))
    for i in range(3):
        _segment(writer, _ok(f"a{i}"), _ok(f"b{i}"))
    storage.reads.clear()
    assert tally.update() == (6, 0)
    assert len(storage.reads) == 3

    storage.reads.clear()
    storage.listed.clear()
    assert tally.update() == (6, 0)  # nothing new: a listing, no read
    assert storage.reads == []
    assert storage.listed == []  # and the listing starts after the last counted: it is empty

    assert (tally.usage.input_tokens, tally.usage.output_tokens) == (30, 18)
    _segment(writer, _ok("c"), _bad("d"))
    assert tally.update() == (8, 1)
    assert (tally.usage.input_tokens, tally.usage.output_tokens) == (35, 21)  # the error line has none
    assert storage.listed == storage.reads  # the listing returned only the new segment
    assert len(storage.reads) == 1 and storage.reads[0] == writer.segments()[-1]


def test_the_tally_counts_as_a_full_scan_does_when_attempts_overlap_or_the_log_is_cleared(tmp_path) -> None:
    storage = CountingStorage()
    prefix = str(tmp_path / "results")
    older = ResultLog(storage, prefix, "b1")  # attempt ids sort by start: this one first
    newer = ResultLog(storage, prefix, "b1")
    _segment(newer, _ok("x"), _ok("y"))
    clock = Clock()
    tally = ResultTally(ResultLog(storage, prefix, "b1"), full_listing_s=30, clock=clock)
    assert tally.update() == (2, 0)

    # The older attempt (a zombie driver) writes late: its answer to x sorts first, so x
    # is an error as merge will publish it, not the success counted so far. A listing
    # after the last counted segment cannot see it; the next whole listing does.
    _segment(older, _bad("x"), _ok("z"))
    clock.now = 29.0
    assert tally.update() == (2, 0)
    clock.now = 30.0
    assert tally.update() == (3, 1) == (len(older.scan()[0]), older.scan()[1])
    assert tally.usage.input_tokens == 10  # y and z answered; x's first answer is the error

    for uri in older.segments():
        if older.attempt_id in uri:
            LocalStorage._path(uri).unlink()  # the older attempt's segments cleared
    _segment(newer, _ok("w"))
    clock.now = 60.0
    assert tally.update() == (3, 0) == (len(newer.scan()[0]), newer.scan()[1])


class StubbedXComRuns(BatchRuns):
    """``BatchRuns`` with the two step values a test gives instead of the metadata DB's."""

    def __init__(self, storage: LocalStorage, root: str, values: dict[str, Any]) -> None:
        super().__init__("batch_inference", storage, root)
        self.values = values
        self.xcom_reads: list[str] = []

    def _xcom(self, run_id: str, task_id: str) -> Any:
        self.xcom_reads.append(task_id)
        return self.values.get(task_id)


def test_polls_of_a_running_batch_read_new_segments_and_nothing_of_finished_shards(tmp_path) -> None:
    storage = CountingStorage()
    root, run_id = str(tmp_path), f"openai__alpha__{tmp_path.name}"  # the caches are per process
    work = str(tmp_path / "work")
    shards = []
    for index in range(2):
        uri = str(tmp_path / f"shard-{index}.jsonl")
        LocalStorage().write_bytes(uri, b'{"custom_id": "a"}\n{"custom_id": "b"}\n')
        shards.append(ShardSpec(index, uri, index * 2 + 1, 2, 40).as_dict())
    logs = [ResultLog(storage, results_prefix(work, ShardSpec.from_dict(s).name),
                      fingerprint_shard(storage, s["uri"]).binding, flush_every=10**6) for s in shards]
    runs = StubbedXComRuns(storage, root, {"validate": {"total_requests": 4}, "split": shards})

    def poll(*dispatch: TaskState) -> tuple[int, int, int] | None:
        snap = RunSnapshot("batch_1", {}, "running", {
            "validate": [TaskState("success", 1, 2)], "split": [TaskState("success", 2, 3)],
            "dispatch": list(dispatch)})
        runs._live_counts(snap, run_id, work)
        return snap.live_counts

    _segment(logs[0], _ok("a"))
    _segment(logs[1], _bad("a"))
    assert poll(TaskState("running", 3), TaskState("running", 3)) == (4, 2, 1)
    assert runs.xcom_reads == ["validate", "split"]

    storage.reads.clear()
    listings = storage.listings
    _segment(logs[0], _ok("b"))
    written = sorted(LocalStorage().list(logs[0].prefix))[-1]
    assert poll(TaskState("running", 3), TaskState("running", 3)) == (4, 3, 1)
    assert runs.xcom_reads == ["validate", "split"]  # succeeded steps: read once
    assert storage.reads == [written] and storage.listings == listings + 2

    # Shard 0's task succeeded: one last count, then neither listing nor read for it.
    assert poll(TaskState("success", 3, 9), TaskState("running", 3)) == (4, 3, 1)
    storage.reads.clear()
    listings = storage.listings
    _segment(logs[1], _ok("b"))
    written = sorted(LocalStorage().list(logs[1].prefix))[-1]
    assert poll(TaskState("success", 3, 9), TaskState("running", 3)) == (4, 4, 1)
    assert storage.reads == [written] and storage.listings == listings + 1


def test_a_running_batch_reads_batch_json_only_when_a_step_that_writes_it_may_have(tmp_path) -> None:
    from aibrix_operators.batch_api.airflow_runs import RunRow

    runs = StubbedXComRuns(CountingStorage(), str(tmp_path), {})
    row = RunRow("openai__alpha__b", "b", "running", {"output_uri": f"{tmp_path}/alpha/b"})

    def reads(run_state: str = "running", **steps: list[TaskState]) -> int:
        return len(runs._storage_reads(row, RunSnapshot("b", row.conf, run_state, dict(steps))))

    started, queued = TaskState("running", 5), TaskState("queued")
    done = TaskState("success", 5, 6)
    assert reads(validate=[queued]) == 0  # nothing has run
    assert reads(validate=[started]) == 2  # validate writes batch.json when it refuses the file
    assert reads(validate=[done], split=[done], dispatch=[started, started]) == 0  # dispatch: none
    assert reads(validate=[done], dispatch=[done], merge=[started]) == 2
    assert reads(validate=[done], dispatch=[done], record_failure=[started]) == 2
    assert reads("success", validate=[done]) == 2
