"""The cleanup task: delete the batch outputs whose ``output_expires_after`` has come.

Reads the deployment's expiry index (``expiring/`` under ``[aibrix_batch] state_root``, written by
merge) and deletes what is due with ``batch/output_expiry.sweep``, at the wall clock's now (never a
run's logical date: a run triggered with a date in the future must not delete what has not expired).
Each file is checked against the deployment's storage allow-list, with the connection the batch
wrote it with, before it is deleted. ``dags/output_cleanup.py`` runs it every hour.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from aibrix_operators.batch.output_expiry import expiry_index, sweep
from aibrix_operators.hooks.batch_storage import BatchStorageHook
from aibrix_operators.settings.locations import state_aws_conn_id, state_root
from aibrix_operators.storage import Storage, is_s3
from aibrix_operators.trust.deployment import load_policy
from aibrix_operators.trust.policy import TrustViolation

log = logging.getLogger(__name__)


class SweepExpiredOutputsOperator(BaseOperator):
    """Delete expired batch outputs (local and S3); fails, after deleting what it may, when a
    record names a file the allow-list does not cover or cannot be read (the log says which)."""

    def execute(self, context: Context) -> dict[str, Any]:
        root = expiry_index(state_root())
        index = BatchStorageHook(state_aws_conn_id()).storage_for(root)
        policy = load_policy()

        def allowed(uri: str, aws_conn_id: str | None) -> str | None:
            try:
                policy.check_storage(uri, "output_uri")
                if is_s3(uri):
                    policy.check_aws_conn(aws_conn_id)
            except TrustViolation as exc:
                return str(exc)
            return None

        def storage_for(uri: str, aws_conn_id: str | None) -> Storage:
            return BatchStorageHook(aws_conn_id).storage_for(uri)

        result = sweep(index, root, time.time(), storage_for, allowed)
        for uri in result.deleted:
            log.info("deleted expired %s", uri)
        log.info("%d expired file(s) deleted, %d batch(es) done, %d not due yet", len(result.deleted),
                 result.records_done, result.not_due)
        if result.refused:
            for why in result.refused:
                log.error("not deleted: %s", why)
            raise AirflowFailException(f"{len(result.refused)} expiry record(s) refused; see the log")
        return {"deleted": len(result.deleted), "batches": result.records_done, "not_due": result.not_due}
