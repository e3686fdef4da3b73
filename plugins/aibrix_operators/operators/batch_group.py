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

from aibrix_operators.airflow_recovery import dispatch_retry_policy
from aibrix_operators.hooks.driver_pods import dispatch_pool
from aibrix_operators.operators.batch import (
    MergeBatchOperator,
    RecordBatchFailureOperator,
    SplitBatchOperator,
    ValidateBatchOperator,
)
from aibrix_operators.operators.dispatch import DispatchShardOperator
from aibrix_operators.sensors import AutoscaleSensor, RolesReadySensor, ScaleDownOperator


class BatchGroup(NamedTuple):
    group: TaskGroup
    validate: Any
    merge: Any  # downstream steps hang off merge: the group's leaves include record_failure,
    # which is skipped when the batch succeeds (and would skip an all_success child)


def batch_inference_group(
    group_id: str, *, input_uri: Any, output_uri: Any, endpoint: Any = "", model: Any = None,
    inference_conn_id: Any = None, aws_conn_id: Any = None, requests_per_shard: Any = 5000,
    bytes_per_shard: Any = 64 * 1024 * 1024, concurrency: Any = 64, max_attempts: Any = 5,
    request_timeout_s: Any = 600, endpoint_wait_s: Any = 300, outage_budget_s: Any = 900,
    completion_window: Any = "24h", execution_mode: Any = "local", metadata: Any = None,
    cache_salt: Any = None,
) -> BatchGroup:
    """Build the group in the current DAG context; arguments may be templates or XComArgs."""
    with TaskGroup(group_id=group_id) as group:
        validate = ValidateBatchOperator(
            task_id="validate", input_uri=input_uri, output_uri=output_uri, batch_endpoint="auto",
            expected_model=model, max_requests=50_000, max_file_bytes=200 * 1024 * 1024,
            max_line_bytes=4 * 1024 * 1024, completion_window=completion_window,
            metadata=metadata or {}, aws_conn_id=aws_conn_id, endpoint=endpoint,
            inference_conn_id=inference_conn_id,
        )
        split = SplitBatchOperator(task_id="split", validated=validate.output,
                                   requests_per_shard=requests_per_shard,
                                   bytes_per_shard=bytes_per_shard, aws_conn_id=aws_conn_id)
        dispatch = DispatchShardOperator.partial(
            task_id="dispatch", validated=validate.output, endpoint=endpoint,
            inference_conn_id=inference_conn_id, concurrency=concurrency, max_attempts=max_attempts,
            request_timeout_s=request_timeout_s, endpoint_wait_s=endpoint_wait_s,
            outage_budget_s=outage_budget_s, execution_mode=execution_mode, cache_salt=cache_salt,
            kubernetes_namespace="", kubernetes_service_account="", aws_conn_id=aws_conn_id,
            pool=dispatch_pool(), **dispatch_retry_policy(),
        ).expand(shard=split.output)
        merge = MergeBatchOperator(task_id="merge", validated=validate.output, shards=split.output,
                                   outcomes=dispatch.output, aws_conn_id=aws_conn_id)
        record_failure = RecordBatchFailureOperator(
            task_id="record_failure", aws_conn_id=aws_conn_id, output_uri=output_uri,
            input_uri=input_uri, trigger_rule="one_failed",
            validate_task_id=f"{group_id}.validate",
            step_task_ids=tuple(f"{group_id}.{t}" for t in ("split", "dispatch", "merge")),
        )
        [validate, split, dispatch, merge] >> record_failure
        roles_ready = RolesReadySensor(task_id="roles_ready", validated=validate.output,
                                       execution_mode=execution_mode, aws_conn_id=aws_conn_id)
        autoscale = AutoscaleSensor(task_id="autoscale", validated=validate.output, shards=split.output,
                                    execution_mode=execution_mode, aws_conn_id=aws_conn_id)
        scale_down = ScaleDownOperator(task_id="scale_down", execution_mode=execution_mode)
        split >> roles_ready >> [dispatch, autoscale]
        [merge, autoscale] >> scale_down
    return BatchGroup(group, validate, merge)
