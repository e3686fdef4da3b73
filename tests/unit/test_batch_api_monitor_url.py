"""monitor_url: the Batch API's extra field naming the Airflow UI page of the batch's run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from aibrix_operators.batch.lifecycle import RunSnapshot
from aibrix_operators.batch_api.app import _present
from aibrix_operators.batch_api.settings import load_settings

BATCH = "batch_" + "0" * 32


def settings(values: dict[str, str], ui_base_url: str | None = None):
    return load_settings(values.get, Path("/r"), ui_base_url=ui_base_url)


def test_the_ui_base_url_is_the_default_and_the_api_key_overrides_it():
    assert settings({}).monitor_url("r") is None  # nothing configured: null, not a guessed host
    assert settings({}, "http://airflow:8080/").monitor_url("r") == "http://airflow:8080/dags/batch_inference/runs/r"
    s = settings({"api_monitor_base_url": "https://ui.example/airflow/"}, "http://internal:8080")
    assert s.monitor_url("r") == "https://ui.example/airflow/dags/batch_inference/runs/r"


def test_the_run_id_is_quoted_whole():
    url = settings({}, "http://a").monitor_url("openai__t__b/../x+y:z?q#f")
    assert url == "http://a/dags/batch_inference/runs/openai__t__b%2F..%2Fx%2By%3Az%3Fq%23f"


def test_every_batch_object_carries_it():
    ctx = SimpleNamespace(settings=settings({}, "http://ui:8080"))
    snap = RunSnapshot(BATCH, {"completion_window": "24h", "batch_endpoint": "/v1/chat/completions"},
                       "queued", {})
    obj = _present(ctx, "team-a", snap)
    assert obj["monitor_url"] == f"http://ui:8080/dags/batch_inference/runs/openai__team-a__{BATCH}"
