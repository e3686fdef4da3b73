"""The deployment's limit on a batch's token budget, from the ``[aibrix_batch]`` section.

    [aibrix_batch]
    max_batch_tokens = 50000000      # unset: no limit; a batch may set any max_total_tokens

With it set, a batch's ``max_total_tokens`` (batch/stop_rules.py) may not exceed it (validate fails
the batch with ``invalid_stop_rules``, the Batch API answers 400) and a batch that sets none gets it:
no batch on this deployment runs unbounded.
"""

from __future__ import annotations

from aibrix_operators import config_sections

SECTION = config_sections.BATCH
KEY = "max_batch_tokens"


class StopRulesSettingError(ValueError):
    """The deployment's ``max_batch_tokens`` is not a whole number >= 1."""


def parse_max_batch_tokens(raw: str | None) -> int | None:
    """The limit from its config text; unset or empty: None (no limit). A bad value names its key."""
    text = (raw or "").strip().replace("_", "")
    if not text:
        return None
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise StopRulesSettingError(f"[{SECTION}] {KEY} = {raw[:40]!r} is not a whole number of tokens >= 1")
    return int(text)


def load_max_batch_tokens() -> int | None:
    """Read fresh from the Airflow config (``AIRFLOW__AIBRIX_BATCH__MAX_BATCH_TOKENS`` or airflow.cfg)."""
    from airflow.sdk import conf

    return parse_max_batch_tokens(conf.get(SECTION, KEY, fallback=None))
