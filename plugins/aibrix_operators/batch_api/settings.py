"""Deployment settings of the Batch API (the ``api_*`` keys of ``[aibrix_batch]``).

Clients choose none of these: where files and outputs live, which connection
reads them, which models exist and where they are served. The API derives every
DAG param from them, and the DAG checks its own allow-list again on top.

    [aibrix_batch]
    api_storage_root = s3://team-batches/api        # tenants' files and outputs, one prefix each
    api_aws_conn_id = batch_s3                       # empty: the default boto3 chain
    api_models = gpt-4o-mini=conn:vllm_prod, tiny-llama=http://127.0.0.1:8000
    api_max_file_bytes = 209715200                   # 200 MB, OpenAI's limit
    api_dag_conf = {"concurrency": 64}               # extra DAG params the deployment fixes
    api_monitor_base_url = https://airflow.example.com  # the UI's public URL in monitor_url;
                                                     # default: Airflow's [api] base_url
    min_completion_window = 1h                       # shortest window (the DAG checks it too)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from aibrix_operators.batch.cost import Prices, parse_prices
from aibrix_operators.batch.job_pool import JobPoolLimits
from aibrix_operators.batch.records import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MIN_COMPLETION_WINDOW,
    parse_completion_window,
)
from aibrix_operators.settings.admission import parse_admission_mode
from aibrix_operators.settings.completion_window import min_completion_window_s
from aibrix_operators.settings.job_pool import job_pool_limits
from aibrix_operators.settings.stop_rules import parse_max_batch_tokens

DAG_ID = "batch_inference"
# DAG params a deployment may fix through api_dag_conf; never anything that names a place,
# a connection or a file (those the API derives itself).
TUNABLE_PARAMS = frozenset({
    "requests_per_shard", "bytes_per_shard", "concurrency", "max_attempts", "endpoint_wait_s",
    "outage_budget_s", "request_timeout_s", "max_requests", "max_line_bytes", "execution_mode",
})


@dataclass(frozen=True)
class ModelRoute:
    """Where requests for one model name go: a free-form endpoint or an inference connection."""

    endpoint: str | None = None
    inference_conn_id: str | None = None

    def dag_params(self) -> dict[str, Any]:
        if self.inference_conn_id:
            return {"inference_conn_id": self.inference_conn_id, "endpoint": ""}
        return {"endpoint": self.endpoint or "", "inference_conn_id": None}


@dataclass(frozen=True)
class ApiSettings:
    storage_root: str
    aws_conn_id: str | None = None
    models: dict[str, ModelRoute] = field(default_factory=dict)
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    dag_conf: dict[str, Any] = field(default_factory=dict)
    dag_id: str = DAG_ID
    # The Airflow UI's public base URL; None: batch objects carry monitor_url = null.
    monitor_base_url: str | None = None
    # Bounds on a batch's ``pool`` (the same [aibrix_batch] pool_* keys the DAG checks).
    pool_limits: JobPoolLimits = field(default_factory=JobPoolLimits)
    # The shortest completion_window a batch may ask for ([aibrix_batch] min_completion_window,
    # the same key the DAG's validate step checks; settings/completion_window.py).
    min_window_s: int = parse_completion_window(DEFAULT_MIN_COMPLETION_WINDOW)
    # The largest token budget a batch may set ([aibrix_batch] max_batch_tokens, the same key the
    # DAG's validate step applies; settings/stop_rules.py); None: no limit.
    max_batch_tokens: int | None = None
    # The deployment's state root ([aibrix_batch] state_root, settings/locations.py); None: this
    # deployment deletes no outputs, and a batch asking for output_expires_after is refused.
    state_root: str | None = None
    state_aws_conn_id: str | None = None
    # What an infeasible window gets ([aibrix_batch] admission, settings/admission.py), for estimates.
    admission: str = "warn"
    # The deployment's prices ([aibrix_batch] prices, batch/cost.py); None: no cost lines.
    prices: Prices | None = None

    def monitor_url(self, run_id: str) -> str | None:
        """The Airflow UI page of the batch's run (its grid view): ``{base}/dags/{dag}/runs/{run}``,
        the route of Airflow 3's UI; the run id is quoted whole (it may hold ``+`` or ``:``)."""
        if not self.monitor_base_url:
            return None
        return f"{self.monitor_base_url}/dags/{quote(self.dag_id, safe='')}/runs/{quote(run_id, safe='')}"


def parse_models(text: str | None) -> dict[str, ModelRoute]:
    """``name=http://host:port, other=conn:conn_id`` → routes."""
    routes: dict[str, ModelRoute] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, target = item.partition("=")
        name, target = name.strip(), target.strip()
        if not sep or not name or not target:
            raise ValueError(f"api_models entry {item!r} must be name=URL or name=conn:CONN_ID")
        if target.startswith("conn:"):
            routes[name] = ModelRoute(inference_conn_id=target[len("conn:"):])
        else:
            routes[name] = ModelRoute(endpoint=target)
    return routes


def load_settings(get: Callable[[str], str | None], default_root: Path,
                  ui_base_url: str | None = None) -> ApiSettings:
    """Settings from a config getter (``get("api_models")``); ``default_root`` when unset.

    ``ui_base_url`` is Airflow's own ``[api] base_url``, the fallback of ``api_monitor_base_url``:
    a deployment that tells Airflow its public URL need not say it twice; one whose API
    is reached under another name than its UI (a proxy) sets the key."""
    dag_conf = json.loads(get("api_dag_conf") or "{}")
    unknown = set(dag_conf) - TUNABLE_PARAMS
    if unknown:
        raise ValueError(f"api_dag_conf may set only {sorted(TUNABLE_PARAMS)}, not {sorted(unknown)}")
    root = (get("api_storage_root") or "").strip() or str(default_root)
    return ApiSettings(
        storage_root=root.rstrip("/"),
        aws_conn_id=(get("api_aws_conn_id") or "").strip() or None,
        models=parse_models(get("api_models")),
        max_file_bytes=int(get("api_max_file_bytes") or DEFAULT_MAX_FILE_BYTES),
        dag_conf=dag_conf,
        monitor_base_url=((get("api_monitor_base_url") or "").strip() or (ui_base_url or "").strip()
                          ).rstrip("/") or None,
        pool_limits=job_pool_limits(get),
        min_window_s=min_completion_window_s(get),
        max_batch_tokens=parse_max_batch_tokens(get("max_batch_tokens")),
        state_root=(get("state_root") or "").strip() or None,
        state_aws_conn_id=(get("state_aws_conn_id") or "").strip() or None,
        admission=parse_admission_mode(get("admission")),
        prices=parse_prices(get("prices")),
    )
