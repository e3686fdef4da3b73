"""The Airflow side: batches are runs of ``batch_inference``, read and triggered in-process.

The API runs inside the api-server, which holds a metadata-DB session factory,
so it uses Airflow's own Python API (``trigger_dag``) and models (``DagRun``,
``TaskInstance``, ``XComModel``) directly: no service credentials to keep for a
REST hop, one indexed query per page instead of one HTTP call per batch, and
the DAG run stays the only record of a batch.

Run ids are ``openai__<tenant>__<batch_id>``; tenant names cannot contain ``_``,
so the prefix match of a tenant never catches another's runs.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from aibrix_operators.batch.job import cancel_marker_uri, work_prefix
from aibrix_operators.batch.lifecycle import BatchStatus, RunSnapshot, Step, TaskState, batch_status
from aibrix_operators.batch.merging import BATCH_FILE
from aibrix_operators.batch.partial import partial_answers
from aibrix_operators.batch.records import Usage
from aibrix_operators.batch.shard_results import ResultLog, ResultTally, fingerprint_shard, results_prefix
from aibrix_operators.batch.sharding import ShardSpec
from aibrix_operators.batch_api.batches import API_CONF_KEY
from aibrix_operators.batch_api.files import batch_output_uri
from aibrix_operators.storage import Storage, StorageError, join_uri

RUN_PREFIX = "openai__"
_TERMINAL_RUN_STATES = ("success", "failed")
# Statuses whose request counts come live from the drivers' checkpoints.
RUNNING = (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING, BatchStatus.FINALIZING)
# What storage says about a finished run (batch.json, cancel marker) never changes until the
# run is cleared and ends again, with a new end_date: cached per (run id, end_date), so a page
# of finished batches costs no storage reads after the first.
_FINISHED: dict[tuple[str, datetime | None], tuple[dict[str, Any] | None, int | None]] = {}
_FINISHED_MAX = 20_000
# A poll of a running batch (``aibrix-batch status --watch``: once a second per watcher)
# must cost the api-server little, however far the batch has got. What a finished step
# produced never changes until the step runs again, with a new end date, so it is kept
# per (run id, step, end): validate's and split's return values, and the final counts of
# a shard whose dispatch task succeeded. A running shard keeps a tally that reads only the
# result segments written since the last poll. The three are bounded; past a bound the
# cache starts over (a cost, never a wrong count).
_STEP_VALUES: dict[tuple[str, str, int | None], Any] = {}
_SHARD_COUNTS: dict[tuple[str, int, int | None], tuple[int, int, Usage]] = {}
_TALLIES: dict[tuple[str, str, int | None], ResultTally] = {}
_CACHE_MAX = 20_000
_TALLIES_MAX = 1_000  # each holds its shard's answered ids
_TALLIES_LOCK = threading.Lock()
# Storage reads of one page run side by side: each is mostly a wait on the object store.
_READS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="batch-api-read")


def run_id_for(tenant: str, batch_id: str) -> str:
    return f"{RUN_PREFIX}{tenant}__{batch_id}"


def _ts(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value else None


@dataclass
class RunRow:
    run_id: str
    batch_id: str
    state: str
    conf: dict[str, Any]
    end_date: datetime | None = None


class BatchRuns:
    """Triggers and reads the batch runs of one DAG, for one storage root."""

    def __init__(self, dag_id: str, storage: Storage, root: str) -> None:
        self.dag_id = dag_id
        self.storage = storage
        self.root = root

    # ------------------------------------------------------------------ write
    def trigger(self, run_id: str, conf: dict[str, Any], created_at: int) -> tuple[RunRow, bool]:
        """Start the run; if a run with this id exists (an idempotent retry), return it instead.

        The run's ``run_after`` is the batch's ``created_at``: the instant its window starts from
        for the deadline weights and the drivers (batch/deadline.py) is the one the API shows."""
        from airflow.api.common.trigger_dag import trigger_dag
        from airflow.exceptions import DagRunAlreadyExists
        from airflow.utils.types import DagRunTriggeredByType

        try:
            dag_run = trigger_dag(self.dag_id, run_id=run_id, conf=conf,
                                  run_after=datetime.fromtimestamp(created_at, UTC),
                                  triggered_by=DagRunTriggeredByType.REST_API,
                                  triggering_user_name="openai-batch-api")
        except DagRunAlreadyExists:
            existing = self.get(run_id)
            assert existing is not None
            return existing, False
        assert dag_run is not None
        return RunRow(run_id, run_id.rsplit("__", 1)[-1], str(dag_run.state), dict(dag_run.conf or {})), True

    def record_cancel(self, run_id: str, at: int) -> None:
        """Note the cancel request on the run itself (``conf[openai_batch][cancelling_at]``).

        The drivers stop on the storage marker; this copy lets a page of runs that have not
        started a task yet show ``cancelling`` without one storage read per run.
        """
        from airflow.models import DagRun
        from airflow.utils.session import create_session
        from sqlalchemy import select

        with create_session() as session:
            run = session.scalar(select(DagRun).where(DagRun.dag_id == self.dag_id, DagRun.run_id == run_id))
            if run is None:
                return
            conf = dict(run.conf or {})
            api = dict(conf.get(API_CONF_KEY) or {})
            api.setdefault("cancelling_at", at)
            run.conf = {**conf, API_CONF_KEY: api}

    # ------------------------------------------------------------------ read
    def get(self, run_id: str) -> RunRow | None:
        rows = self._rows([run_id], None, None, 1)
        return rows[0] if rows else None

    def list(self, tenant: str, after_run_id: str | None, limit: int) -> list[RunRow]:
        """The tenant's runs, newest first (by the run table's id), starting after ``after``."""
        return self._rows(None, f"{RUN_PREFIX}{tenant}__", after_run_id, limit)

    def _rows(self, run_ids: list[str] | None, prefix: str | None, after: str | None,
              limit: int) -> list[RunRow]:
        from airflow.models import DagRun
        from airflow.utils.session import create_session
        from sqlalchemy import select

        with create_session() as session:
            query = select(DagRun.id, DagRun.run_id, DagRun.state, DagRun.conf, DagRun.end_date).where(
                DagRun.dag_id == self.dag_id)
            if run_ids is not None:
                query = query.where(DagRun.run_id.in_(run_ids))
            if prefix is not None:
                query = query.where(DagRun.run_id.startswith(prefix, autoescape=True))
            if after is not None:
                pivot = session.scalar(select(DagRun.id).where(
                    DagRun.dag_id == self.dag_id, DagRun.run_id == after))
                if pivot is None:
                    return []
                query = query.where(DagRun.id < pivot)
            query = query.order_by(DagRun.id.desc()).limit(limit)
            return [RunRow(r.run_id, r.run_id.rsplit("__", 1)[-1], str(r.state), dict(r.conf or {}),
                           r.end_date) for r in session.execute(query)]

    def snapshots(self, rows: Iterable[RunRow]) -> list[RunSnapshot]:
        """Everything ``status.batch_object`` needs, with one task-instance query for all rows."""
        from airflow.models import TaskInstance
        from airflow.utils.session import create_session
        from sqlalchemy import select

        rows = list(rows)
        if not rows:
            return []
        tasks: dict[str, dict[str, list[TaskState]]] = {r.run_id: {} for r in rows}
        with create_session() as session:
            query = select(TaskInstance.run_id, TaskInstance.task_id, TaskInstance.state,
                           TaskInstance.start_date, TaskInstance.end_date, TaskInstance.map_index).where(
                TaskInstance.dag_id == self.dag_id, TaskInstance.run_id.in_([r.run_id for r in rows]))
            for ti in session.execute(query.order_by(TaskInstance.map_index)):
                tasks[ti.run_id].setdefault(ti.task_id, []).append(
                    TaskState(str(ti.state) if ti.state else None, _ts(ti.start_date), _ts(ti.end_date)))
        snaps = [RunSnapshot(r.batch_id, r.conf, _run_state(r.state), tasks[r.run_id]) for r in rows]
        # Every storage read the page needs, then all of them at once.
        wanted: dict[str, list[str]] = {}
        for row, snap in zip(rows, snaps, strict=True):
            cached = _FINISHED.get((row.run_id, row.end_date))
            if cached is not None and snap.run_state in _TERMINAL_RUN_STATES:
                snap.batch_json, snap.cancel_at = cached
            else:
                wanted[row.run_id] = self._storage_reads(row, snap)
        uris = [u for reads in wanted.values() for u in reads]
        found = dict(zip(uris, _READS.map(self._read_json, uris), strict=True)) if uris else {}
        for row, snap in zip(rows, snaps, strict=True):
            if row.run_id not in wanted:
                continue
            output = str(row.conf.get("output_uri", ""))
            snap.cancel_at = _int_or_none((row.conf.get(API_CONF_KEY) or {}).get("cancelling_at"))
            if wanted[row.run_id]:
                snap.batch_json = found.get(join_uri(output, BATCH_FILE))
                marker = found.get(cancel_marker_uri(work_prefix(output, row.run_id)))
                if marker is not None:
                    snap.cancel_at = _int_or_none(marker.get("at")) or snap.cancel_at
            if snap.run_state in _TERMINAL_RUN_STATES and snap.batch_json is not None:
                # Only a record that was read: a store hiccup (read as None) is not remembered.
                if len(_FINISHED) >= _FINISHED_MAX:
                    _FINISHED.clear()
                _FINISHED[(row.run_id, row.end_date)] = (snap.batch_json, snap.cancel_at)
            elif batch_status(snap) in RUNNING:
                self._live_counts(snap, row.run_id, work_prefix(output, row.run_id))
        return snaps

    def _storage_reads(self, row: RunRow, snap: RunSnapshot) -> list[str]:
        """The objects this run's batch object depends on, ``batch.json`` and the cancel
        marker, when a step that writes ``batch.json`` may have written it.

        Validate writes it when the file is refused, merge and record_failure at the end.
        Between validate's success and the start of either of the others (the whole time
        dispatch runs) nothing can have written it, and a cancel is on the run itself
        (``record_cancel``, in the same API call that writes the marker), so polling a
        running batch reads neither. A page of queued runs reads nothing either."""
        output = str(row.conf.get("output_uri", ""))
        if not output.startswith(self.root + "/"):
            return []  # not a run this API made: show nothing from storage
        if snap.run_state not in _TERMINAL_RUN_STATES:
            started = any(t.start is not None for states in snap.tasks.values() for t in states)
            validated = _succeeded(snap.step(Step.VALIDATE))
            ending = any(t.start is not None for step in (Step.MERGE, Step.RECORD_FAILURE)
                         for t in snap.step(step))
            if not started or (validated and not ending):
                return []
        return [join_uri(output, BATCH_FILE), cancel_marker_uri(work_prefix(output, row.run_id))]

    def _live_counts(self, snap: RunSnapshot, run_id: str, work: str) -> None:
        validated = self._step_value(snap, run_id, Step.VALIDATE)
        if isinstance(validated, dict):
            snap.total_requests = int(validated.get("total_requests") or 0)
            snap.estimate = validated.get("estimate") if isinstance(validated.get("estimate"), dict) else None
        shards = self._step_value(snap, run_id, Step.SPLIT)
        if not isinstance(shards, list):
            return
        split_end = _end_if_succeeded(snap.step(Step.SPLIT))
        # Dispatch is mapped over split's list: task i is shard i once every task exists.
        dispatch = snap.step(Step.DISPATCH)
        dispatch = dispatch if len(dispatch) == len(shards) else []
        answered = errors = 0
        usage = Usage()
        for index, item in enumerate(shards):
            shard = ShardSpec.from_dict(item)
            done_key = None
            if dispatch and dispatch[index].state == "success":
                done_key = (run_id, index, dispatch[index].end)
                if done_key in _SHARD_COUNTS:
                    shard_answered, shard_errors, shard_usage = _SHARD_COUNTS[done_key]
                    answered += shard_answered
                    errors += shard_errors
                    usage.merge(shard_usage)
                    continue
            tally_key = (run_id, shard.name, split_end)
            try:
                tally = self._tally(tally_key, shard, work)
                shard_answered, shard_errors = tally.update()
            except (StorageError, OSError):
                continue  # a shard being written or a store hiccup: counts catch up next poll
            answered += shard_answered
            errors += shard_errors
            usage.merge(tally.usage)
            if done_key is not None and split_end is not None:
                _remember(_SHARD_COUNTS, done_key, (shard_answered, shard_errors, tally.usage))
                with _TALLIES_LOCK:
                    _TALLIES.pop(tally_key, None)
        snap.live_counts = (snap.total_requests or sum(s["num_requests"] for s in shards), answered, errors)
        snap.live_usage = usage.as_dict()
        snap.shard_count = len(shards)
        snap.shards_done = tuple(i for i, t in enumerate(dispatch) if t.state == "success")

    def partial_output(self, snap: RunSnapshot, run_id: str) -> Iterator[bytes]:
        """The answers of every shard ``snap`` saw finished (``batch/partial.py``)."""
        shards = self._step_value(snap, run_id, Step.SPLIT)
        if not isinstance(shards, list):
            return iter(())
        work = work_prefix(str(snap.conf.get("output_uri", "")), run_id)
        return partial_answers(self.storage, [ShardSpec.from_dict(s) for s in shards], snap.shards_done, work)

    def _tally(self, key: tuple[str, str, int | None], shard: ShardSpec, work: str) -> ResultTally:
        """The shard's tally, kept across polls while split's output stands (``key[2]``)."""
        with _TALLIES_LOCK:
            tally = _TALLIES.get(key)
        if tally is not None:
            return tally
        binding = fingerprint_shard(self.storage, shard.uri).binding
        tally = ResultTally(ResultLog(self.storage, results_prefix(work, shard.name), binding))
        if key[2] is not None:
            with _TALLIES_LOCK:
                if len(_TALLIES) >= _TALLIES_MAX:
                    _TALLIES.clear()
                tally = _TALLIES.setdefault(key, tally)
        return tally

    def _step_value(self, snap: RunSnapshot, run_id: str, step: Step) -> Any:
        """A step's return value, read once after the step succeeded."""
        end = _end_if_succeeded(snap.step(step))
        key = (run_id, str(step), end)
        if end is not None and key in _STEP_VALUES:
            return _STEP_VALUES[key]
        value = self._xcom(run_id, step)
        if end is not None and value is not None:
            _remember(_STEP_VALUES, key, value)
        return value

    def _xcom(self, run_id: str, task_id: str) -> Any:
        from airflow.models.xcom import XComModel
        from airflow.utils.session import create_session
        from sqlalchemy import select

        with create_session() as session:
            value = session.scalar(select(XComModel.value).where(
                XComModel.dag_id == self.dag_id, XComModel.run_id == run_id,
                XComModel.task_id == task_id, XComModel.key == "return_value",
                XComModel.map_index == -1))
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return None
        return value

    def _read_json(self, uri: str) -> dict[str, Any] | None:
        try:
            data = json.loads(self.storage.read_bytes(uri))
        except (StorageError, OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def output_uri(self, tenant: str, batch_id: str) -> str:
        return batch_output_uri(self.root, tenant, batch_id)


def _succeeded(tasks: list[TaskState]) -> bool:
    return bool(tasks) and all(t.state == "success" for t in tasks)


def _end_if_succeeded(tasks: list[TaskState]) -> int | None:
    """The end of an unmapped step that succeeded: what its cached values are keyed by."""
    return tasks[0].end if len(tasks) == 1 and tasks[0].state == "success" else None


def _remember(cache: dict, key: Any, value: Any) -> None:
    if len(cache) >= _CACHE_MAX:
        cache.clear()
    cache[key] = value


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value) or None
    except (TypeError, ValueError):
        return None


def _run_state(state: str) -> str:
    return state.rsplit(".", 1)[-1].lower()
