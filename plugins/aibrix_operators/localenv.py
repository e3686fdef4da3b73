"""The environment that points Airflow at this checkout, with nothing in ``$HOME``.

One source of truth for ``make run``, the tests and interactive shells::

    eval "$(.venv/bin/python -m aibrix_operators.localenv)"
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from aibrix_operators.airflow_recovery import RECOVERY_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
WORK_DIR = REPO_ROOT / ".work"
# Airflow's LocalExecutor, keeping parallelism and deadline order (slot_keeping_executor.py); the
# Airflow image and the compose stack name the same class.
EXECUTOR = "aibrix_operators.slot_keeping_executor.SlotKeepingLocalExecutor"


def airflow_env(home: Path | None = None, parallelism: int = 4) -> dict[str, str]:
    home = home or WORK_DIR / "airflow"
    home.mkdir(parents=True, exist_ok=True)
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO_ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO_ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__PARALLELISM": str(parallelism),
        "AIRFLOW__CORE__EXECUTOR": EXECUTOR,
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__API__EXPOSE_CONFIG": "False",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        "VLLM_CACHE_ROOT": str(WORK_DIR / "cache"),
        "PYTHONUNBUFFERED": "1",
        **RECOVERY_ENV,  # as the Airflow image sets them
    }


def default_output_uri(run_id: str) -> str:
    """Where a run's results go when the trigger names no output: its own directory,
    so a failed run can never leave the previous run's batch.json to be read as its own."""
    return str(WORK_DIR / "outputs" / re.sub(r"[^A-Za-z0-9._-]+", "_", run_id))


def main() -> None:
    home = Path(os.environ["AIRFLOW_HOME"]) if "AIRFLOW_HOME" in os.environ else None
    for key, value in airflow_env(home).items():
        print(f"export {key}={shlex.quote(value)}")


if __name__ == "__main__":
    main()
