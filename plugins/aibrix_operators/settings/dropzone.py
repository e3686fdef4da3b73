"""The drop zone's deployment settings: the ``[aibrix_dropzone]`` section of the Airflow config.

    [aibrix_dropzone]
    inbox = s3://team-batches/inbox/        # required: where files land
    outbox = s3://team-batches/outbox/      # required: results under outbox/<name>/
    aws_conn_id = batch_s3                  # empty: boto3's default chain (the worker's identity)
    dag_conf = {"endpoint": "http://vllm:8000", "model": "llama-3-8b"}   # batch_inference params
    poll_interval_s = 30                    # seconds between two looks at the inbox
    wait_timeout_s = 3600                   # one sensor run waits this long, then the next starts
    max_files_per_run = 32                  # drops started by one run; the rest by the next

Nobody who drops a file chooses any of these (the same as the Batch API's settings): the batch
still checks its own ``[aibrix_batch]`` allow-list, so inbox, outbox and connection must be on it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aibrix_operators import config_sections
from aibrix_operators.batch.records import (
    DEFAULT_MIN_COMPLETION_WINDOW,
    check_min_window,
    parse_completion_window,
)
from aibrix_operators.dropzone.core import DERIVED_PARAMS, DropZone, DropZoneConfigError
from aibrix_operators.settings.completion_window import load_min_completion_window_s

SECTION = config_sections.DROPZONE


@dataclass(frozen=True)
class DropZoneSettings:
    zone: DropZone
    aws_conn_id: str | None = None
    dag_conf: dict[str, Any] = field(default_factory=dict)
    poll_interval_s: float = 30.0
    wait_timeout_s: float = 3600.0
    max_files_per_run: int = 32


_DEFAULT_MIN_WINDOW_S = parse_completion_window(DEFAULT_MIN_COMPLETION_WINDOW)


def parse_settings(get: Callable[[str], str | None],
                   min_window_s: int = _DEFAULT_MIN_WINDOW_S) -> DropZoneSettings:
    """Settings from a key → value getter; ``DropZoneConfigError`` says what is wrong.

    ``min_window_s``: the deployment's ``[aibrix_batch] min_completion_window``; a
    ``completion_window`` in ``dag_conf`` under it would fail every dropped file's batch, so it
    is refused here, once, naming the minimum."""
    inbox, outbox = (get("inbox") or "").strip(), (get("outbox") or "").strip()
    if not inbox or not outbox:
        raise DropZoneConfigError(
            f"the drop zone is not configured: set inbox and outbox in the [{SECTION}] section of the "
            f"Airflow config (or AIRFLOW__{SECTION.upper()}__INBOX / __OUTBOX)")
    try:
        dag_conf = json.loads(get("dag_conf") or "{}")
    except json.JSONDecodeError as exc:
        raise DropZoneConfigError(f"[{SECTION}] dag_conf is not JSON: {exc}") from None
    if not isinstance(dag_conf, dict):
        raise DropZoneConfigError(f"[{SECTION}] dag_conf must be a JSON object of batch_inference params")
    window = dag_conf.get("completion_window")
    if window is not None:
        try:
            check_min_window(str(window), min_window_s)
        except ValueError as exc:
            raise DropZoneConfigError(f"[{SECTION}] dag_conf: {exc}; every file dropped would fail "
                                      "validation with it") from None
    derived = sorted(DERIVED_PARAMS & set(dag_conf))
    if derived:
        raise DropZoneConfigError(f"[{SECTION}] dag_conf may not set {', '.join(derived)}: "
                                  "the drop zone derives them from each file")
    try:
        numbers = {key: float(get(key) or default) for key, default in
                   (("poll_interval_s", 30), ("wait_timeout_s", 3600), ("max_files_per_run", 32))}
    except ValueError as exc:
        raise DropZoneConfigError(f"[{SECTION}]: {exc}") from None
    if numbers["poll_interval_s"] <= 0 or numbers["wait_timeout_s"] <= 0 or numbers["max_files_per_run"] < 1:
        raise DropZoneConfigError(f"[{SECTION}] poll_interval_s, wait_timeout_s and max_files_per_run "
                                  "must be positive")
    return DropZoneSettings(
        zone=DropZone.parse(inbox, outbox),
        aws_conn_id=(get("aws_conn_id") or "").strip() or None,
        dag_conf=dag_conf,
        poll_interval_s=numbers["poll_interval_s"],
        wait_timeout_s=numbers["wait_timeout_s"],
        max_files_per_run=int(numbers["max_files_per_run"]),
    )


def load_settings() -> DropZoneSettings:
    """Read fresh from the worker's Airflow config at run time (no DAG re-parse needed)."""
    from airflow.sdk import conf

    return parse_settings(lambda key: conf.get(SECTION, key, fallback=None), load_min_completion_window_s())
