"""The shortest ``completion_window`` a batch may ask for, from the ``[aibrix_batch]`` section.

    [aibrix_batch]
    min_completion_window = 1h       # default 1h; a duration like 1h, 90m, 3600s

Batches are ordered by their deadline (``scheduling/deadline_order.py``, and permits within a driver), so a
batch with a tiny window would always go first; the floor keeps that lever fair between tenants.
The Batch API (400, param ``completion_window``), the DAG's validate step (the batch fails with
``invalid_completion_window``) and the drop zone's settings all check it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from aibrix_operators import config_sections
from aibrix_operators.batch.records import (
    DEFAULT_MIN_COMPLETION_WINDOW,
    MIN_WINDOW_SETTING,
    parse_completion_window,
)

SECTION = config_sections.BATCH
KEY = "min_completion_window"
# Where messages say the minimum comes from: the core's name for it (batch/records.py).
SETTING = MIN_WINDOW_SETTING


class MinWindowSettingError(ValueError):
    """The deployment's ``min_completion_window`` is not a duration."""


def min_completion_window_s(get: Callable[[str], str | None]) -> int:
    """The minimum in seconds from a config getter (``get("min_completion_window")``); unset or
    empty: the default (1h). A bad value names its key."""
    raw = (get(KEY) or "").strip() or DEFAULT_MIN_COMPLETION_WINDOW
    try:
        return parse_completion_window(raw)
    except ValueError:
        raise MinWindowSettingError(f"{SETTING} = {raw[:40]!r} is not a duration like 1h, 90m or "
                                    "3600s") from None


def load_min_completion_window_s() -> int:
    """Read fresh from the Airflow config (``AIRFLOW__AIBRIX_BATCH__MIN_COMPLETION_WINDOW`` or
    airflow.cfg). Outside Airflow (a process without it installed) only the environment variable
    is read, as Airflow would read it."""
    try:
        from airflow.sdk import conf
    except ImportError:
        env = f"AIRFLOW__{SECTION.upper()}__{KEY.upper()}"
        return min_completion_window_s(lambda _key: os.environ.get(env))
    return min_completion_window_s(lambda key: conf.get(SECTION, key, fallback=None))
