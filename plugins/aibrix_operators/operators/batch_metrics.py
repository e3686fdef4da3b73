"""The batch gauges' hooks in the DAG's tasks: one call per task boundary (``batch/metrics.py``).

validate → ``validating`` with the request count and the window; split → ``in_progress`` with
the shard count; each dispatch task's end → shards done; merge → ``finalizing``, then the final
status and counts; record_failure → ``failed``. Never per request, never raising.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from aibrix_operators.batch.lifecycle import TERMINAL, BatchStatus
from aibrix_operators.batch.metrics import URL_ENV, BatchSnapshot, publish

log = logging.getLogger(__name__)
_STARTS_AND_ENDS = frozenset({BatchStatus.VALIDATING, *TERMINAL})


def batch_published(batch_id: str, **fields: Any) -> bool:
    """Push what this task knows; a batch start or end also prunes long-finished batches."""
    phase = fields.get("phase")
    if phase is not None:
        fields["phase"] = phase = str(phase)  # a plain label value, whatever the caller passed
    return publish(BatchSnapshot(batch_id, **fields), prune_now=phase in _STARTS_AND_ENDS)


def shard_finished(context: Any, batch_id: str) -> bool:
    """After a dispatch task's shard ended: the shard tasks Airflow counts as succeeded, plus this
    one (still running). Racing dispatch tasks each push a count, none increments a shared value."""
    if not os.environ.get(URL_ENV):
        return False  # not configured: not even the count is asked for
    ti = context["ti"]
    try:
        done = ti.get_ti_count(dag_id=ti.dag_id, task_ids=[ti.task_id], run_ids=[ti.run_id],
                               states=["success"]) + 1
    except Exception as exc:  # noqa: BLE001 - no count (e.g. no execution API): skip this push
        log.warning("batch metrics: no shard count from Airflow (%s); shards done is pushed at merge", exc)
        return False
    return batch_published(batch_id, shards_done=done)
