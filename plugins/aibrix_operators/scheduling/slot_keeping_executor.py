"""Airflow's LocalExecutor, counting each dispatched workload against ``parallelism`` until it ends.

The single-machine deployment's executor (``[core] executor =
aibrix_operators.scheduling.slot_keeping_executor.SlotKeepingLocalExecutor``: the Airflow image,
the compose stack and the local stack set it). On several machines Airflow's own Celery, Edge or
Kubernetes executor is the one to use: they count what they dispatched, and nothing here is needed
(docs/scheduling.md). Airflow 3.3's LocalExecutor hands each workload to its worker processes'
queue without recording it as running (apache/airflow#71914), and two things the pipeline relies
on break:

- **Deadline order.** The scheduler sees every slot free, so each loop moves more scheduled
  task instances to queued, and the workers take them first come, first served. The
  ``priority_weight`` that ``deadline_order.py`` sets only orders task instances that are
  scheduled in the same loop, so a later deadline's steps queued earlier run first. Counted,
  task instances wait in ``scheduled`` until a slot frees, and the scheduler then picks the
  heaviest.
- **A try lost per wait.** A rescheduled or deferred task runs again under the same try
  number. When the end of its previous run is read after the task is queued again, the
  scheduler asks ``has_task``; without the running set that says no, and the task is failed as
  "killed externally" (apache/airflow#71172), costing a try. Here a workload's key stays running
  while any dispatch of it has not ended, so the old run's end finds the new run known.

Only public methods are overridden — ``trigger_tasks`` (what left the executor's queues was
dispatched) and ``change_state`` (every end the worker processes report passes through it) — and
public attributes read (``running``, ``queued_tasks``, ``queued_callbacks``). Even so the class
depends on how LocalExecutor behaves, so it refuses an Airflow it was not verified on:
``SUPPORTED_AIRFLOW`` names the minor versions whose LocalExecutor
``tests/unit/test_slot_keeping_executor.py`` has run against. An upgrade fails at the scheduler's
start with a message that says what to do, never at its first result read.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import airflow
from airflow.executors.local_executor import LocalExecutor

# Minor versions of Airflow whose LocalExecutor this class was verified on (its unit tests).
SUPPORTED_AIRFLOW = ("3.3",)
# The state a worker reports when it starts a workload (a callback's RUNNING; tasks send none).
_STARTED = "running"


class UnverifiedAirflowError(ImportError):
    """The installed Airflow is not one this executor was verified on."""


def check_airflow_version(version: str) -> None:
    """Raise UnverifiedAirflowError unless ``version``'s major.minor is in SUPPORTED_AIRFLOW."""
    minor = ".".join(version.split(".")[:2])
    if minor not in SUPPORTED_AIRFLOW:
        raise UnverifiedAirflowError(
            f"SlotKeepingLocalExecutor was verified on Airflow {', '.join(SUPPORTED_AIRFLOW)}, and "
            f"Airflow {version} is installed. Run tests/unit/test_slot_keeping_executor.py against it: "
            "if Airflow's own LocalExecutor now keeps dispatched tasks in `running` "
            "(test_airflows_own_local_executor_frees_the_slot_at_dispatch fails), set "
            "[core] executor = LocalExecutor and drop this class; otherwise add the version to "
            "SUPPORTED_AIRFLOW in aibrix_operators/scheduling/slot_keeping_executor.py."
        )


check_airflow_version(airflow.__version__)


class SlotKeepingLocalExecutor(LocalExecutor):
    """LocalExecutor whose dispatched workloads hold a ``parallelism`` slot until they end."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Dispatches of each key not ended yet: more than one when a task was queued again
        # (after a reschedule or a deferral) before the end of its previous run was read.
        self._unended: Counter = Counter()

    def trigger_tasks(self, open_slots: int) -> None:
        waiting = set(self.queued_tasks) | set(self.queued_callbacks)
        super().trigger_tasks(open_slots)
        # What left the queues was handed to the worker processes.
        for key in waiting.difference(self.queued_tasks, self.queued_callbacks):
            self._unended[key] += 1
            self.running.add(key)

    def change_state(self, key: Any, state: Any, info: Any = None, remove_running: bool = True) -> None:
        if str(state) == _STARTED:
            remove_running = False  # a start frees nothing
        elif remove_running and key in self._unended:
            self._unended[key] -= 1
            if self._unended[key] > 0:
                remove_running = False  # another dispatch of the same key is still out
            else:
                del self._unended[key]
        super().change_state(key, state, info, remove_running=remove_running)
