"""How the pipeline recovers from a lost Airflow node, and the settings that make it quick.

With Airflow's defaults a scheduler node lost together with the task processes it ran (a
LocalExecutor's tasks are the scheduler's children) cost ~5 minutes and a try per loss
(issue 19, finding 17): the dead tasks stayed ``running`` until the orphan check
(``orphaned_tasks_check_interval``, 300 s) or the heartbeat timeout
(``task_instance_heartbeat_timeout``, 300 s) caught them, and each loss used one of the
dispatch task's two retries.

``RECOVERY_ENV`` notices a lost task within a minute: a running task's supervisor heartbeats
every 5 s (``[workers] min_heartbeat_interval``), so 40 s without one is eight missed, not a
slow machine (the whole suite, two xdist workers on two cores, runs with it and no task fails
a heartbeat); with the 5 s detection interval and the 5 s retry delay a lost node's shard
resumes ~50 s after the loss (issue 37's bound is 60 s; docs/multi-node.md); the replacement
scheduler checks for the dead scheduler's tasks every 30 s, and a scheduler is dead after
30 s without a heartbeat. The Airflow image sets the same values (a packaging test compares
them), so the compose stack and a Kubernetes deployment built on the image get them too.

Dispatch tasks get ``DEFAULT_DISPATCH_RETRIES`` tries beyond the first: a retry resumes from
the shard's checkpoints, so it costs the lost minute and no request twice, and a batch
survives several node losses. Failures of the batch's own making (forbidden, bad input,
trust) fail at once without retrying (AirflowFailException), so the budget is spent only on
infrastructure. ``[aibrix_batch] dispatch_retries`` changes it.

Measured recovery time: docs/failure-semantics.md ("A lost scheduler node").
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from aibrix_operators import config_sections

RECOVERY_ENV: dict[str, str] = {
    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "40",
    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
    "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "30",
    "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": "30",
}
DEFAULT_DISPATCH_RETRIES = 6
# What a lost node may cost before the shard resumes: detection (heartbeat timeout or orphan
# check) plus the retry delay; the recovery test holds the pipeline to it.
RECOVERY_BOUND_S = 150


def dispatch_retry_policy() -> dict[str, Any]:
    """BaseOperator retry arguments of a dispatch task; read at DAG parse time."""
    from airflow.sdk import conf

    retries = conf.getint(config_sections.BATCH, "dispatch_retries", fallback=DEFAULT_DISPATCH_RETRIES)
    if retries < 0:
        raise ValueError(f"[aibrix_batch] dispatch_retries must be >= 0, not {retries}")
    return {"retries": retries, "retry_delay": timedelta(seconds=5)}
