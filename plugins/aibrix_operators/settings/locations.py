"""Where a deployment keeps batch data: each location is the deployment's setting, never a path
inside the installed package.

On several machines a local path is one node's disk: validate and split would write where a
dispatch on another node cannot read (issue 37). So nothing here falls back to a folder of the
checkout: a location that is needed and not set is a ``LocationNotSet`` that names the setting.
Local development (``make run``, the tests) sets them all to folders under ``.work``
(``localenv.airflow_env``), which is the only place that knows the checkout.

``[aibrix_batch]`` keys (``AIRFLOW__AIBRIX_BATCH__<KEY>``):

* ``output_root``: where a run whose trigger names no ``output_uri`` writes (``<root>/<run id>``);
* ``api_storage_root``: the Batch API's files and batch records;
* ``eval_report_root``: the nightly eval's plans, reports and history when a run names no
  ``report_uri``;
* ``lora_cache_dir``: the node-local folder adapters are fetched into (per node by design: each
  node verifies what it loads);
* ``state_root`` (and ``state_aws_conn_id`` for an ``s3://`` one): the pipeline's deployment-wide
  state: the index of outputs that expire (``batch/output_expiry.py``), the endpoints' measured
  rates and the admission queue (``batch/admission.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

from aibrix_operators import config_sections

SECTION = config_sections.BATCH
_RUN_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class LocationNotSet(ValueError):
    """A location the deployment must set is not set; the message names the key."""


def configured(key: str) -> str | None:
    """The deployment's value of ``[aibrix_batch] key``, stripped; None when unset or empty."""
    from airflow.sdk import conf

    value = (conf.get(SECTION, key, fallback=None) or "").strip()
    return value or None


def required(key: str, what: str) -> str:
    value = configured(key)
    if value is None:
        raise LocationNotSet(
            f"[{SECTION}] {key} is not set ({what}): set it in the deployment's Airflow config "
            f"(AIRFLOW__{SECTION.upper()}__{key.upper()}), an s3:// prefix when workers run on "
            "several machines"
        )
    return value.rstrip("/")


def default_output_uri(run_id: str) -> str:
    """Where a run's results go when its trigger names no output: its own folder under the
    deployment's ``output_root``, so a failed run never leaves an earlier run's batch.json to be
    read as its own."""
    root = required("output_root", "where a batch goes when its trigger names no output_uri")
    return f"{root}/{_RUN_ID_UNSAFE.sub('_', run_id)}"


def api_storage_root() -> str:
    return required("api_storage_root", "where the Batch API keeps files and batches")


def eval_report_root() -> str:
    return required("eval_report_root", "where the nightly eval writes when a run names no report_uri")


def lora_cache_dir() -> Path:
    return Path(required("lora_cache_dir", "the node-local folder LoRA adapters are fetched into"))


def state_root() -> str:
    return required("state_root", "where the pipeline keeps outputs that expire, measured rates and "
                                  "the admission queue")


def state_aws_conn_id() -> str | None:
    """The connection that reads and writes an ``s3://`` ``state_root``; None: boto3's defaults."""
    return configured("state_aws_conn_id")
