"""What a batch whose window cannot be met gets (``[aibrix_batch] admission``, batch/admission.py).

    [aibrix_batch]
    admission = warn        # warn (default): admitted, its estimate says at risk; refuse: failed in
                            # validation with window_infeasible; off: no estimate
"""

from __future__ import annotations

from aibrix_operators import config_sections
from aibrix_operators.batch.admission import DEFAULT_MODE, MODES

SECTION = config_sections.BATCH
KEY = "admission"


class AdmissionSettingError(ValueError):
    """``admission`` is not one of the modes."""


def parse_admission_mode(raw: str | None) -> str:
    mode = (raw or "").strip().lower() or DEFAULT_MODE
    if mode not in MODES:
        raise AdmissionSettingError(f"[{SECTION}] {KEY} = {raw!r} is not one of {', '.join(MODES)}")
    return mode


def load_admission_mode() -> str:
    from airflow.sdk import conf

    return parse_admission_mode(conf.get(SECTION, KEY, fallback=None))
