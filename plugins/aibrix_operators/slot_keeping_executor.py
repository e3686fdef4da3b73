"""Airflow's LocalExecutor, counting each dispatched workload against ``parallelism`` until it ends.

The deployment's executor (``[core] executor =
aibrix_operators.slot_keeping_executor.SlotKeepingLocalExecutor``: the Airflow image, the
compose stack and the local stack set it). Airflow 3.3's LocalExecutor hands each workload to
its worker processes' queue without recording it as running (apache/airflow#71914), and two
things the pipeline relies on break:

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
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from airflow.executors.local_executor import LocalExecutor

# The state a worker reports when it starts a workload (a task's or a callback's RUNNING).
_STARTED = "running"


class SlotKeepingLocalExecutor(LocalExecutor):
    """LocalExecutor whose dispatched workloads hold a ``parallelism`` slot until they end."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Dispatches of each key not ended yet: more than one when a task was queued again
        # (after a reschedule or a deferral) before the end of its previous run was read.
        self._unended: Counter = Counter()

    def _process_workloads(self, workload_list: list[Any]) -> None:
        super()._process_workloads(workload_list)
        for workload in workload_list:
            self._unended[workload.key] += 1
            self.running.add(workload.key)

    def _read_results(self) -> None:
        while not self.result_queue.empty():
            key, state, _exc = self.result_queue.get()
            if str(state) == _STARTED:
                self.change_state(key, state, remove_running=False)
                continue
            self._unended[key] -= 1
            ended = self._unended[key] <= 0
            if ended:
                del self._unended[key]
            self.change_state(key, state, remove_running=ended)
