"""A batch's deadline, owned here: the instant it was submitted plus its completion window.

OpenAI's window starts when the batch is created, and so does ours, whoever reads it: the Batch
API's ``expires_at`` and its status line, the deadline weights that order batches in Airflow's
queues (``scheduling/deadline_order.py``), and the drivers, which stop sending at it (``batch.json``'s
``expires_at``, from ``validate_batch``). A batch that waits two hours for a worker has two
hours less to run, not two hours more than it was shown.

The submission instant is the run's ``run_after``: when the run was asked for. Airflow sets it
(the UI's and the REST API's trigger, a schedule, the drop zone's trigger), and the Batch API
triggers its runs with ``run_after`` at its own ``created_at`` (whole seconds), so the object a
client reads and the run agree to the second. It is never read from the run's conf: whoever
triggers a run writes that, and an earlier "submission" would buy an earlier place in the queue.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from aibrix_operators.batch.records import DEFAULT_COMPLETION_WINDOW, parse_completion_window


def submitted_at(run_after: datetime | None) -> int:
    """The batch's submission instant in whole Unix seconds (what ``created_at`` shows): its run's
    ``run_after``; now for code run outside a DAG run (a unit test, ``validate_batch`` alone)."""
    return int(run_after.timestamp()) if run_after is not None else int(time.time())


def deadline(submitted: int, window: str) -> int:
    """When the batch expires (Unix seconds); ValueError for a window that is not a duration."""
    return submitted + parse_completion_window(window)


def run_deadline(conf: Mapping[str, Any] | None, run_after: datetime | None) -> int | None:
    """A run's deadline from its conf's window (or the default) and its ``run_after``; ``None``
    for a window no parser reads (the validate step fails that batch and says why)."""
    window = conf.get("completion_window") if isinstance(conf, Mapping) else None
    try:
        return deadline(submitted_at(run_after), str(window or DEFAULT_COMPLETION_WINDOW))
    except ValueError:
        return None
