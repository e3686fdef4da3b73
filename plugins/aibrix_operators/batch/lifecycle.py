"""A batch's lifecycle in one place: its statuses, the pipeline's steps, and how a run's state
becomes a status (core: no Airflow).

The Batch API reports a status derived from the run's task instances; the pipeline builds its
tasks from ``Step``; the metrics export one series per ``PHASES`` entry. Renaming a step or
adding a status is a change here, and every reader follows.

=====================================================  ==============
run queued, or validate not yet succeeded              validating
validate succeeded, merge not started                  in_progress
dispatch all done, merge queued/running                finalizing
batch.json says completed / expired / cancelled        that status
batch.json says failed, or the run failed              failed
cancel marker present and not yet terminal             cancelling
=====================================================  ==============

Sources of truth, in order: ``batch.json`` once the run has published it (merge or
record_failure), the task instances while it runs, the cancel marker for ``cancelling``.

The error codes a batch can end with (in its error lines and in ``batch.json``'s ``errors``) are
the lifecycle's too; they have their own module beside this one, ``batch/error_codes.py``
(``RequestError``, ``ValidationCode``, ``BatchFailure``), imported from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class BatchStatus(StrEnum):
    """OpenAI's batch statuses (``batch.json``'s and the Batch API's ``status``)."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


TERMINAL = frozenset({BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED,
                      BatchStatus.CANCELLED})  # fmt: skip
# Ends whose output file may hold answers: a failed batch's only when a stop rule stopped it after
# answers came (its batch.json names the files; one that failed otherwise names none).
ENDED_WITH_OUTPUT = frozenset({BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED,
                               BatchStatus.FAILED})
# The statuses a batch passes through as gauges (one series each): cancelling is the API's view
# of a cancel marker, not a phase the pipeline publishes.
PHASES = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING,
          BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)  # fmt: skip


class Step(StrEnum):
    """The pipeline's steps: the task ids of ``operators/pipeline.py``."""

    VALIDATE = "validate"
    SPLIT = "split"
    ROLES_READY = "roles_ready"
    DISPATCH = "dispatch"
    MERGE = "merge"
    RECORD_FAILURE = "record_failure"
    AUTOSCALE = "autoscale"
    SCALE_DOWN = "scale_down"


# Airflow task-instance states after which a task will not run again in this try.
_DONE_TI = ("success", "failed", "skipped", "upstream_failed", "removed")
_RUN_ENDED = ("success", "failed")


@dataclass
class TaskState:
    state: str | None
    start: int | None = None
    end: int | None = None


@dataclass
class RunSnapshot:
    """What the Batch API knows of one run: its conf, state, task instances and outputs."""

    batch_id: str
    conf: dict[str, Any]
    run_state: str
    tasks: dict[str, list[TaskState]] = field(default_factory=dict)
    batch_json: dict[str, Any] | None = None
    cancel_at: int | None = None
    # (total, answered, errors) from the drivers' checkpoints while dispatch runs.
    live_counts: tuple[int, int, int] | None = None
    # While it runs: the tokens of the answers so far (OpenAI's ``usage`` shape; merge's totals later).
    live_usage: dict[str, Any] | None = None
    # The estimate validate admitted the batch with (batch/admission.py), while it has not ended.
    estimate: dict[str, Any] | None = None
    total_requests: int | None = None
    # While dispatch runs: how many shards the batch has, and which have finished (their
    # dispatch succeeded): the partial output is theirs.
    shard_count: int | None = None
    shards_done: tuple[int, ...] = ()

    def step(self, step: Step) -> list[TaskState]:
        return self.tasks.get(step, [])


def _all(tasks: list[TaskState], states: tuple[str, ...]) -> bool:
    return bool(tasks) and all(t.state in states for t in tasks)


def batch_status(snap: RunSnapshot) -> BatchStatus:
    published = (snap.batch_json or {}).get("status")
    if published == BatchStatus.FAILED:
        return BatchStatus.FAILED
    if snap.run_state in _RUN_ENDED:
        # A corrupt batch.json may hold anything as its status: only a known end counts.
        known = isinstance(published, str) and published in TERMINAL
        return BatchStatus(published) if known else BatchStatus.FAILED
    merge, dispatch = snap.step(Step.MERGE), snap.step(Step.DISPATCH)
    if snap.cancel_at is not None:
        return BatchStatus.CANCELLING
    if not _all(snap.step(Step.VALIDATE), ("success",)):
        return BatchStatus.VALIDATING
    if merge and merge[0].state in ("running", "queued", "scheduled", "success") and _all(dispatch, _DONE_TI):
        return BatchStatus.FINALIZING
    return BatchStatus.IN_PROGRESS
