"""Earliest deadline first across batch runs: an Airflow cluster policy that weights the tasks.

When several batches wait for the same worker slots or dispatch pool, Airflow's scheduler
queues the task instances with the highest ``priority_weight`` first. This policy
(``task_instance_mutation_hook``, registered through the package's ``airflow.policy`` entry
point, so a deployment that installs the package gets it) gives every pipeline step of a batch
run the same weight, larger for an earlier deadline: the batch whose window closes first has
its validate, split, dispatch and merge queued before a later one's. The deadline is the batch's
own (``batch/deadline.py``: its run's ``run_after`` plus its ``completion_window``), the one the
API shows and the driver enforces, computed without a database query (the hook runs inside the
scheduler's transaction and must not open one).

Weights: ``WEIGHT_ORIGIN - deadline in minutes since the epoch``, so any two runs compare by
deadline whatever their submission time (about 9.7e8 for 2026; positive until the year 3870).
Tasks of other DAGs keep their own weights; pipeline steps rank above them, which is the point
on a worker pool the batches share with nothing else — give other DAGs their own pool.
"""

from __future__ import annotations

from typing import Any

from airflow.policies import hookimpl

from aibrix_operators.batch.deadline import run_deadline
from aibrix_operators.batch.lifecycle import Step

WEIGHT_ORIGIN = 1_000_000_000
_STEPS = frozenset(s.value for s in Step)


def deadline_weight(deadline: int) -> int:
    return WEIGHT_ORIGIN - int(deadline // 60)


def _mark_hook_live() -> None:
    """Airflow 3.x marks the mutation hook a no-op unless an ``airflow_local_settings.py`` defines
    one (``settings.import_local_settings``), so a policy registered only through the
    ``airflow.policy`` entry point is skipped when a run's task instances are first created
    (``DagRun._get_task_creator``: only mapped expansions called it). This module is imported by
    ``settings.initialize`` while it loads entry-point policies, so it says the hook is live."""
    try:
        from airflow import settings
    except ImportError:  # not inside Airflow (a unit test importing the module)
        return
    hook = getattr(settings, "task_instance_mutation_hook", None)
    if hook is not None and getattr(hook, "is_noop", False):
        hook.is_noop = False


_mark_hook_live()


@hookimpl
def task_instance_mutation_hook(task_instance: Any, dag_run: Any) -> None:
    if dag_run is None or str(task_instance.task_id).rsplit(".", 1)[-1] not in _STEPS:
        return
    deadline = run_deadline(getattr(dag_run, "conf", None), getattr(dag_run, "run_after", None))
    if deadline is not None:
        task_instance.priority_weight = deadline_weight(deadline)
