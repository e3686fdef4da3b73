"""Where batch data goes is the deployment's setting: no folder of the package is a fallback
(settings/locations.py, issue 37), and no allow-list means nothing is allowed."""

from __future__ import annotations

import pytest

from aibrix_operators.settings.locations import LocationNotSet, default_output_uri, lora_cache_dir
from aibrix_operators.trust.deployment import load_policy
from aibrix_operators.trust.policy import TrustViolation

KEYS = ("OUTPUT_ROOT", "API_STORAGE_ROOT", "EVAL_REPORT_ROOT", "LORA_CACHE_DIR", "ALLOWED_ENDPOINTS",
        "ALLOWED_STORAGE", "ALLOWED_AWS_CONN_IDS", "ALLOWED_INFERENCE_CONN_IDS")


@pytest.fixture
def bare(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A deployment that set none of the locations and no allow-list."""
    for key in KEYS:
        monkeypatch.delenv(f"AIRFLOW__AIBRIX_BATCH__{key}", raising=False)
    return monkeypatch


def test_a_run_without_output_uri_needs_the_deployments_output_root(bare: pytest.MonkeyPatch) -> None:
    with pytest.raises(LocationNotSet, match=r"\[aibrix_batch\] output_root is not set.*"
                                             r"AIRFLOW__AIBRIX_BATCH__OUTPUT_ROOT.*s3://"):
        default_output_uri("manual__2026-12-05T10:00:00")
    bare.setenv("AIRFLOW__AIBRIX_BATCH__OUTPUT_ROOT", "s3://batches/out/")
    # Each run its own folder, named safely, under the deployment's prefix.
    assert default_output_uri("manual__2026-12-05T10:00:00+00:00") == (
        "s3://batches/out/manual__2026-12-05T10_00_00_00_00")


def test_the_lora_cache_is_the_deployments_folder(bare: pytest.MonkeyPatch, tmp_path) -> None:
    with pytest.raises(LocationNotSet, match="lora_cache_dir"):
        lora_cache_dir()
    bare.setenv("AIRFLOW__AIBRIX_BATCH__LORA_CACHE_DIR", str(tmp_path))
    assert lora_cache_dir() == tmp_path


def test_a_deployment_without_an_allow_list_allows_nothing_and_says_which_keys(bare) -> None:
    policy = load_policy()
    with pytest.raises(TrustViolation, match="sets none of .*allowed_endpoints"):
        policy.check_endpoint("http://127.0.0.1:8000")
    with pytest.raises(TrustViolation, match="allowed_storage"):
        policy.check_storage("/tmp/anything", "output_uri")
