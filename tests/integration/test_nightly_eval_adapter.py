"""nightly_eval of a model and its LoRA adapter, end to end: `airflow dags test
nightly_eval__reverse_facts` → one batch naming the base and the adapter → a real vLLM CPU server
that loads the adapter at run time, pulled from SeaweedFS through the deployment's registry.

Night 1: the trained adapter (``train_eval_adapter.py``) beside its base: the adapter's gain on
the task the base never learnt lies outside both confidence intervals, side by side in the
report. Night 2: the deployment publishes a degraded adapter under the same name (a new digest,
so it loads in place from a new folder): a regression of the adapter alone, the base unchanged.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import uuid
from pathlib import Path

import pytest

from aibrix_operators.localenv import REPO_ROOT, WORK_DIR
from aibrix_operators.serving.local_vllm import VLLMServer, VLLMServerSpec
from aibrix_operators.serving.model_manifest import MANIFEST_NAME, write_manifest
from tests.integration.conftest import INFERENCE_PYTHON, TEST_BUCKET
from tests.integration.services import S3Server
from tests.integration.test_nightly_eval import EVAL_MODEL, SERVED, eval_dag

pytestmark = pytest.mark.e2e

ADAPTER = "eval-llama-reverse"
ADAPTER_DIR = WORK_DIR / "models" / ADAPTER
DEGRADED_DIR = WORK_DIR / "models" / f"{ADAPTER}-degraded"
SUITE = "reverse_facts"


@pytest.fixture(scope="module")
def trained() -> Path:
    """The eval model and its adapter (`make eval-model` trains both; no-ops when cached)."""
    for script, args in (("train_eval_model.py", [EVAL_MODEL]),
                         ("train_eval_adapter.py", [EVAL_MODEL, ADAPTER_DIR])):
        subprocess.run([str(INFERENCE_PYTHON), str(REPO_ROOT / "inference_images/vllm" / script),
                        *map(str, args)], check=True)
    return ADAPTER_DIR


def publish(s3: S3Server, folder: Path) -> dict[str, str]:
    """Upload an adapter with its manifest; the registry entry that pins it."""
    write_manifest(folder)
    prefix = f"adapters/{folder.name}-{uuid.uuid4().hex[:8]}"
    client = s3.client()
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        client.upload_file(str(path), TEST_BUCKET, f"{prefix}/{path.name}")
    pin = hashlib.sha256((folder / MANIFEST_NAME).read_bytes()).hexdigest()
    return {"name": ADAPTER, "base_model": SERVED, "uri": f"s3://{TEST_BUCKET}/{prefix}/",
            "manifest_sha256": pin}


@pytest.mark.timeout(1800)
def test_adapter_gain_side_by_side_then_a_regression_of_the_adapter_alone(
    trained, airflow_session_env, s3_server, tmp_path
):
    client = s3_server.ensure_bucket(TEST_BUCKET)
    conn = s3_server.airflow_connection()
    registry = tmp_path / "lora-adapters.json"
    env = {**airflow_session_env, **s3_server.env(), "AIRFLOW_CONN_BATCH_S3": json.dumps(conn),
           "AIRFLOW__AIBRIX_BATCH__LORA_ADAPTERS": str(registry),
           "AIRFLOW__AIBRIX_BATCH__LORA_CACHE_DIR": str(tmp_path / "lora-cache")}
    root = f"s3://{TEST_BUCKET}/nightly-lora"

    def get(key: str) -> bytes:
        return client.get_object(Bucket=TEST_BUCKET, Key=f"nightly-lora/{key}")["Body"].read()

    def night(server: VLLMServer, date: str, adapter: Path) -> tuple[subprocess.CompletedProcess, dict]:
        registry.write_text(json.dumps({"adapters": [publish(s3_server, adapter)]}))
        proc = eval_dag(env, SUITE, {"night": date, "endpoint": server.base_url, "report_uri": root,
                                     "aws_conn_id": "batch_s3", "concurrency": 16}, tmp_path)
        return proc, json.loads(get(f"eval/{SUITE}/{date}/summary.json"))

    spec = VLLMServerSpec(model=str(EVAL_MODEL), served_model_name=SERVED, max_model_len=256,
                          compact_engine=True, extra_args=["--enable-lora", "--max-lora-rank", "8"],
                          env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    with VLLMServer(spec) as server:
        proc, first = night(server, "2026-11-01", trained)
        assert proc.returncode == 0, proc.stdout[-5000:]
        base, lora = first["models"][SERVED]["interval"], first["models"][ADAPTER]["interval"]
        assert base["n"] == lora["n"] == 40 and first["failed_requests"] == 0
        # The adapter's gain on the task lies outside both confidence intervals.
        assert lora["low"] > base["high"], (base, lora)
        report = get(f"eval/{SUITE}/2026-11-01/report.html").decode()
        assert "The model and its adapters" in report and "CIs apart" in report
        adapter_results = get(f"eval/{SUITE}/2026-11-01/results.{ADAPTER}.jsonl").splitlines()
        assert len(adapter_results) == 40

        proc, second = night(server, "2026-11-02", DEGRADED_DIR)
    assert proc.returncode != 0, "the adapter's regression must fail the run"
    assert f"eval regression in suite {SUITE} (2026-11-02) of {ADAPTER}:" in proc.stdout + proc.stderr
    models = second["models"]
    assert models[ADAPTER]["regression"] and not models[SERVED]["regression"], models
    # The base answered exactly as the night before (greedy), the adapter fell.
    assert models[SERVED]["interval"]["mean"] == base["mean"]
    assert models[ADAPTER]["interval"]["mean"] < lora["mean"] - 0.2
    history = [json.loads(x) for x in get(f"eval/{SUITE}/history.jsonl").splitlines()]
    assert [(h["date"], h["model"], h["regression"]) for h in history] == [
        ("2026-11-01", SERVED, False), ("2026-11-01", ADAPTER, False),
        ("2026-11-02", SERVED, False), ("2026-11-02", ADAPTER, True)]
    md = get(f"eval/{SUITE}/2026-11-02/report.md").decode()
    assert f"| {ADAPTER} | adapter |" in md and "REGRESSION" in md
