"""The environment that points Airflow at this checkout, with nothing in ``$HOME``.

One source of truth for ``make run``, the tests and interactive shells::

    eval "$(.venv/bin/python -m aibrix_operators.localenv)"
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from aibrix_operators.scheduling.recovery import RECOVERY_ENV
from aibrix_operators.trust.policy import local_development_policy

REPO_ROOT = Path(__file__).resolve().parents[2]
WORK_DIR = REPO_ROOT / ".work"
# Airflow's LocalExecutor, keeping parallelism and deadline order (scheduling/slot_keeping_executor.py); the
# Airflow image and the compose stack name the same class.
EXECUTOR = "aibrix_operators.scheduling.slot_keeping_executor.SlotKeepingLocalExecutor"


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
        # Where this checkout keeps batch data (settings/locations.py: a deployment sets these,
        # an s3:// prefix on several machines; nothing in the package falls back to a folder).
        "AIRFLOW__AIBRIX_BATCH__OUTPUT_ROOT": str(WORK_DIR / "outputs"),
        "AIRFLOW__AIBRIX_BATCH__API_STORAGE_ROOT": str(WORK_DIR / "batch-api"),
        "AIRFLOW__AIBRIX_BATCH__EVAL_REPORT_ROOT": str(WORK_DIR),
        "AIRFLOW__AIBRIX_BATCH__LORA_CACHE_DIR": str(WORK_DIR / "lora-cache"),
        "AIRFLOW__AIBRIX_BATCH__STATE_ROOT": str(WORK_DIR / "state"),
        # This checkout's allow-list (trust.local_development_policy): a deployment sets its own.
        **allow_list_env(),
        "VLLM_CACHE_ROOT": str(WORK_DIR / "cache"),
        "PYTHONUNBUFFERED": "1",
        **RECOVERY_ENV,  # as the Airflow image sets them
    }


def allow_list_env() -> dict[str, str]:
    """The local-development allow-list as the deployment's settings: loopback endpoints, the
    checkout's examples/ and .work/, the default AWS credential chain."""
    policy = local_development_policy(REPO_ROOT)
    return {
        "AIRFLOW__AIBRIX_BATCH__ALLOWED_ENDPOINTS": ",".join(policy.endpoints),
        "AIRFLOW__AIBRIX_BATCH__ALLOWED_STORAGE": ",".join(policy.storage),
        "AIRFLOW__AIBRIX_BATCH__ALLOWED_AWS_CONN_IDS": ",".join(policy.aws_conn_ids),
    }


def main() -> None:
    home = Path(os.environ["AIRFLOW_HOME"]) if "AIRFLOW_HOME" in os.environ else None
    for key, value in airflow_env(home).items():
        print(f"export {key}={shlex.quote(value)}")


if __name__ == "__main__":
    main()
