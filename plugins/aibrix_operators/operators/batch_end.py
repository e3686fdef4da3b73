"""What the pipeline keeps when a batch ends, beside its outputs: the endpoint's measured rate and the
batch's place in the admission queue (batch/admission.py), the record of outputs that expire
(batch/output_expiry.py), the engine time its shards used (driver/engine_time.py)."""

from __future__ import annotations

import logging
import time
from typing import Any

from aibrix_operators.batch.admission import dequeue, learn_rate, measured
from aibrix_operators.batch.job import ValidatedBatch
from aibrix_operators.batch.output_expiry import ExpiryRecord, expiring_uris, expiry_index, write_record
from aibrix_operators.batch.records import Usage
from aibrix_operators.hooks.batch_storage import BatchStorageHook
from aibrix_operators.settings.locations import state_aws_conn_id, state_root

log = logging.getLogger(__name__)


def record_expiry(batch: ValidatedBatch, expires_at: int, aws_conn_id: str | None) -> None:
    """Leave the batch's output files in the expiry index, for the cleanup DAG."""
    index = expiry_index(state_root())
    record = ExpiryRecord(batch.batch_id, expires_at, expiring_uris(batch.output_uri), aws_conn_id)
    where = write_record(BatchStorageHook(state_aws_conn_id()).storage_for(index), index, record)
    log.info("the output files expire at %d; recorded in %s", record.expires_at, where)


def learn_and_leave(
    batch: ValidatedBatch, usage: Usage | None, answered: int, seconds: float | None
) -> None:
    """Admission's bookkeeping at the batch's end (batch/admission.py): learn the endpoint's rate from
    what the batch measured (``usage`` None: it ended without merging) and take its work off the
    queue. Best effort: a store that fails costs the next estimates a sample, never the batch."""
    assert batch.admission_key is not None
    try:
        root = state_root()
        state = BatchStorageHook(state_aws_conn_id()).storage_for(root)
        if usage is not None:
            rate = measured(batch.admission_key, usage.input_tokens, usage.output_tokens, seconds,
                            batch.total_bytes, answered, int(time.time()))
            if rate is not None:
                learned = learn_rate(state, root, rate)
                log.info("measured %.1f tokens/s for %s (%d batch(es) so far: %.1f tokens/s)",
                         rate.tokens_per_s, rate.key, learned.batches, learned.tokens_per_s)
        dequeue(state, root, batch.admission_key, batch.batch_id, batch.expires_at)
    except Exception as exc:  # noqa: BLE001 - bookkeeping for later estimates, never this batch's fault
        log.warning("could not update the admission state (%s); later estimates lack this batch", exc)


def engine_time(outcomes: list[dict[str, Any]]) -> float | None:
    """The engine seconds of the batch's shard runs (their outcomes' ``engine_s``); None when a run
    could not measure its share (the figure would be too low, so there is none)."""
    measured = [o.get("engine_s") for o in outcomes]
    if not measured or any(m is None for m in measured):
        return None
    return round(sum(measured), 3)
