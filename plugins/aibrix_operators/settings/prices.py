"""The deployment's prices (``[aibrix_batch] prices``, batch/cost.py), read fresh from Airflow's config."""

from __future__ import annotations

from aibrix_operators import config_sections
from aibrix_operators.batch.cost import Prices, parse_prices

SECTION = config_sections.BATCH
KEY = "prices"


def load_prices() -> Prices | None:
    """``AIRFLOW__AIBRIX_BATCH__PRICES`` or airflow.cfg; unset: None (no cost lines)."""
    from airflow.sdk import conf

    return parse_prices(conf.get(SECTION, KEY, fallback=None))
