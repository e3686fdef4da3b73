"""Earliest deadline first across batch runs: an Airflow cluster policy that weights the tasks.

When several batches wait for the same worker slots or dispatch pool, Airflow's scheduler queues
the task instances with the highest ``priority_weight`` first. This policy
(``task_instance_mutation_hook``) gives every pipeline step of a batch run the same weight,
larger for an earlier deadline: the batch whose window closes first has its validate, split,
dispatch and merge queued before a later one's. The deadline is the batch's own
(``batch/deadline.py``: its run's ``run_after`` plus its ``completion_window``), the one the API
shows and the driver enforces, computed without a database query (the hook runs inside the
scheduler's transaction and must not open one).

Weights: ``WEIGHT_ORIGIN - deadline in minutes since the epoch``, so any two runs compare by
deadline whatever their submission time (about 9.7e8 for 2026; positive until the year 3870).
Tasks of other DAGs keep their own weights; pipeline steps rank above them, which is the point
on a worker pool the batches share with nothing else — give other DAGs their own pool.

Registered by the deployment's ``airflow_local_settings.py`` (``plugins/airflow_local_settings.py``:
the Airflow image puts it in ``$AIRFLOW_HOME/config``, the Helm chart takes it as
``airflowLocalSettings``), Airflow's documented place for cluster policies. Not through the
``airflow.policy`` entry point: Airflow 3.3 marks the mutation hook a no-op unless a local settings
module defines one (``settings.import_local_settings``), so an entry-point policy is skipped when a
run's task instances are created (only mapped expansions call it) — and turning that flag off
from here would be flipping a private flag. One registration, in the file Airflow reads.
"""

from __future__ import annotations

from typing import Any

from aibrix_operators.batch.deadline import run_deadline
from aibrix_operators.batch.lifecycle import Step

WEIGHT_ORIGIN = 1_000_000_000
_STEPS = frozenset(s.value for s in Step)


def deadline_weight(deadline: int) -> int:
    return WEIGHT_ORIGIN - int(deadline // 60)


def task_instance_mutation_hook(task_instance: Any, dag_run: Any) -> None:
    """Weight a batch run's pipeline steps by its deadline; leave every other task alone."""
    if dag_run is None or str(task_instance.task_id).rsplit(".", 1)[-1] not in _STEPS:
        return
    deadline = run_deadline(getattr(dag_run, "conf", None), getattr(dag_run, "run_after", None))
    if deadline is not None:
        task_instance.priority_weight = deadline_weight(deadline)
