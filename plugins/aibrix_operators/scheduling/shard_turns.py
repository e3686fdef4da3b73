"""``max_workers``: at most that many shards of one batch dispatched at once.

Airflow's own per-run cap (``max_active_tis_per_dagrun``) is fixed when the DAG is parsed, and
this one comes with the batch. The rule that enforces it needs nothing but a count Airflow
already keeps: shard ``i`` may start once ``i - max_workers + 1`` of the batch's dispatch tasks
have ended. Every started shard then has an index below ``ended + max_workers``, so at most
``max_workers`` are started and not ended — without a lock, and whatever order the scheduler
picks. A shard whose turn has not come is rescheduled (``up_for_reschedule``): it holds no
worker or pool slot while it waits (a deferred task in a pool that counts deferred tasks would,
and could starve the retry of the very shard it waits for), and waiting costs no try. (Airflow
keeps such a task's start_date from its first check: the log line "shard N starts" marks when
its work began.)

No check comes sooner than ``MIN_CHECK_S`` after the last. Airflow 3.3 fails a rescheduled
task whose previous check's end the executor reports only after the task is scheduled again
(apache/airflow#71172: "finished with state success, but the task instance's state attribute
is queued"), and that costs a try. The report follows the check's end by the supervisor's exit
plus a scheduler loop: 9.6 s on this 2-core VM with one batch running (2026-12-05), so the 5 s
checks of before lost a try on every wait.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from airflow.sdk.exceptions import AirflowRescheduleException

log = logging.getLogger(__name__)

# A task instance that has ended, whatever the outcome (up_for_retry has not: it will run again).
ENDED_STATES = ("success", "failed", "skipped", "upstream_failed", "removed")
# Each check starts a task process; one that waits for many shards checks less often.
CHECK_EVERY_S = 5.0
# About five times the executor's report lag measured here with one batch running (module
# docstring), room for a loaded scheduler: a check that comes before the report of the previous
# one's end is failed by the scheduler.
MIN_CHECK_S = 45.0
CHECK_AT_MOST_EVERY_S = 120.0


def shards_to_wait_for(map_index: int, max_workers: int, ended: int) -> int:
    """How many more of the batch's shards must end before shard ``map_index`` may start."""
    return max(map_index - max_workers + 1 - ended, 0)


def next_check_s(missing: int) -> float:
    """Seconds to the next check: about one shard's end per CHECK_EVERY_S, within
    [MIN_CHECK_S, CHECK_AT_MOST_EVERY_S]."""
    return min(max(CHECK_EVERY_S * missing, MIN_CHECK_S), CHECK_AT_MOST_EVERY_S)


def wait_for_turn(ti: Any, max_workers: int | None) -> None:
    """Return when this shard may start; otherwise raise AirflowRescheduleException."""
    if not max_workers or ti.map_index is None or ti.map_index < max_workers:
        return  # no cap, or among the first max_workers: no count needed
    ended = ti.get_ti_count(dag_id=ti.dag_id, task_ids=[ti.task_id], run_ids=[ti.run_id],
                            states=list(ENDED_STATES))  # fmt: skip
    missing = shards_to_wait_for(ti.map_index, max_workers, ended)
    if missing == 0:
        # The moment the shard's work starts: a rescheduled task keeps the start_date of its
        # first check, so this line is where its log says so.
        log.info("max_workers=%d: shard %d starts (%d of this batch's shards ended)",
                 max_workers, ti.map_index, ended)
        return
    wait_s = next_check_s(missing)
    log.info("max_workers=%d: shard %d waits for %d more shard(s) of this batch to end "
             "(%d ended); next check in %.0fs, holding no worker slot",
             max_workers, ti.map_index, missing, ended, wait_s)  # fmt: skip
    raise AirflowRescheduleException(reschedule_date=datetime.now(UTC) + timedelta(seconds=wait_s))
