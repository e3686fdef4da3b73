"""The batch pipeline as a TaskGroup, for DAGs that run a batch as one of their steps.

``nightly_eval__*`` embeds this group instead of triggering ``batch_inference``: the same
operators (validate → split → roles_ready → dispatch × N → merge, record_failure, autoscale,
scale_down), so there is no second inference path, and — unlike TriggerDagRunOperator — it also
runs under ``airflow dags test`` (which has no scheduler to start a triggered run) and puts the
batch's tasks, logs and retries in the eval run itself. Task ids are prefixed with the group's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from airflow.sdk import TaskGroup

from aibrix_operators.operators.pipeline import add_batch_tasks, param_defaults


class BatchGroup(NamedTuple):
    group: TaskGroup
    validate: Any
    merge: Any  # downstream steps hang off merge: the group's leaves include record_failure,
    # which is skipped when the batch succeeds (and would skip an all_success child)


def batch_inference_group(group_id: str, *, input_uri: Any, output_uri: Any, **params: Any) -> BatchGroup:
    """Build the group in the current DAG context. ``params`` are batch_inference's params
    (templates, XComArgs or values); every one not given keeps batch_inference's default."""
    with TaskGroup(group_id=group_id) as group:
        tasks = add_batch_tasks({**param_defaults(), **params}, input_uri=input_uri,
                                output_uri=output_uri, group_id=group_id)  # fmt: skip
    return BatchGroup(group, tasks.validate, tasks.merge)
