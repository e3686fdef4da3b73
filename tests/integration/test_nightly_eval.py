"""nightly_eval end to end: `airflow dags test` → the batch TaskGroup → real vLLM CPU serving the
trained small model → scores, reports and history dropped off to S3 (SeaweedFS).

Night 1: two suites (arithmetic, multiple_choice) on the trained model; night 2: arithmetic
again, so the report has deltas; night 3: the degraded checkpoint deployed under the same
served name — a real drop, flagged as a regression, its gate task failed, its report written.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from aibrix_operators.localenv import REPO_ROOT, WORK_DIR
from aibrix_operators.serving.local_vllm import VLLMServer, VLLMServerSpec
from tests.integration.conftest import DAGS_TEST, INFERENCE_PYTHON, TEST_BUCKET
from tests.metrics.conftest import start_pushgateway

pytestmark = pytest.mark.e2e

EVAL_MODEL = WORK_DIR / "models" / "eval-llama"
DEGRADED_MODEL = WORK_DIR / "models" / "eval-llama-degraded"
SERVED = "eval-llama"


@pytest.fixture(scope="module")
def eval_model() -> Path:
    """The trained model (`make eval-model` trains it, and `make test` runs that beside the suite's
    parallel pass; this waits on the training's lock, then finds the key matching, or trains it
    when missing, e.g. for a lone pytest run)."""
    subprocess.run([str(INFERENCE_PYTHON), str(REPO_ROOT / "inference_images/vllm/train_eval_model.py"),
                    str(EVAL_MODEL)], check=True)
    return EVAL_MODEL


def serve(model: Path) -> VLLMServer:
    return VLLMServer(VLLMServerSpec(model=str(model), served_model_name=SERVED, max_model_len=256,
                                     compact_engine=True))


def eval_dag(env: dict[str, str], suite: str, conf: dict, log_dir: Path) -> subprocess.CompletedProcess:
    # Forked from the worker's dags-test server (conftest.DAGS_TEST), as `airflow dags test` runs it.
    argv = ["dags", "test", f"nightly_eval__{suite}", "-f", str(REPO_ROOT / "dags" / "nightly_eval.py"),
            "-c", json.dumps(conf)]  # fmt: skip
    proc = DAGS_TEST.run(argv, env, log_dir / f"{suite}-{conf['night']}", timeout_s=600)
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / f"{suite}-{conf['night']}.log").write_text(proc.stdout + proc.stderr)
    return proc


@pytest.fixture
def gateway(tmp_path) -> Iterator[str]:
    with start_pushgateway(tmp_path) as url:
        yield url


def pushed(gateway: str, name: str, **labels: str) -> float:
    """The sum of a sample over the Pushgateway's groups (drivers push one group per process)."""
    with urllib.request.urlopen(gateway + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items())]
    assert values, f"{name}{labels} not on the Pushgateway"
    return sum(values)


# Four nights' DAG runs and two vLLM startups, beside the other xdist worker's tests: 598 s in a
# clean-clone run here (2026-12-03), too close to the suite's 900 s per test for a busier machine.
@pytest.mark.timeout(1800)
def test_nightly_eval_two_suites_deltas_and_a_degraded_night(
    eval_model, airflow_session_env, s3_server, gateway, tmp_path
):
    client = s3_server.ensure_bucket(TEST_BUCKET)
    conn = s3_server.airflow_connection()
    # the evaluate task pushes the night's scores; the shard drivers push their totals
    env = {**airflow_session_env, "AIRFLOW_CONN_BATCH_S3": json.dumps(conn),
           "AIBRIX_PUSHGATEWAY_URL": gateway}
    root = f"s3://{TEST_BUCKET}/nightly"

    def get(key: str) -> bytes:
        return client.get_object(Bucket=TEST_BUCKET, Key=f"nightly/{key}")["Body"].read()

    def summary(suite: str, night: str) -> dict:
        return json.loads(get(f"eval/{suite}/{night}/summary.json"))

    def run(server: VLLMServer, suite: str, night: str) -> subprocess.CompletedProcess:
        return eval_dag(env, suite, {"night": night, "endpoint": server.base_url, "report_uri": root,
                                     "aws_conn_id": "batch_s3", "concurrency": 32}, tmp_path)

    with serve(eval_model) as good:
        for suite in ("arithmetic", "multiple_choice"):
            proc = run(good, suite, "2026-11-01")
            assert proc.returncode == 0, proc.stdout[-5000:]
            assert s3_server.secret_key not in proc.stdout + proc.stderr
            # The eval's batch is batch_inference's pipeline, prefix grouping included.
            assert "prefix grouping auto:" in proc.stdout + proc.stderr
            keys = {o["Key"] for o in client.list_objects_v2(
                Bucket=TEST_BUCKET, Prefix=f"nightly/eval/{suite}/2026-11-01/")["Contents"]}
            for name in ("report.html", "report.md", "results.jsonl", "summary.json", "trend.png",
                         "batch/input.jsonl", "batch/output.jsonl", "batch/batch.json"):
                assert f"nightly/eval/{suite}/2026-11-01/{name}" in keys, (name, sorted(keys))
        arith = summary("arithmetic", "2026-11-01")
        assert arith["interval"]["n"] == 200 and arith["failed_requests"] == 0
        assert arith["interval"]["mean"] >= 0.9, arith  # the trained model learnt held-out additions
        assert arith["comparisons"] == []  # first night: nothing to compare with; it is the baseline
        mc = summary("multiple_choice", "2026-11-01")
        assert mc["interval"]["low"] > 0.25, mc  # well above chance (one in four)
        results = [json.loads(x) for x in get("eval/arithmetic/2026-11-01/results.jsonl").splitlines()]
        assert len(results) == 200 and all(r["answer"] is not None for r in results)

        proc = run(good, "arithmetic", "2026-11-02")
        assert proc.returncode == 0, proc.stdout[-5000:]
        second = summary("arithmetic", "2026-11-02")
        deltas = {c["against"]: c for c in second["comparisons"]}
        assert deltas["previous"]["reference_date"] == "2026-11-01"
        assert deltas["baseline"]["reference_date"] == "2026-11-01"
        assert abs(deltas["previous"]["delta"]) <= 0.02 and not second["regression"]  # greedy: same model
        assert "| previous (2026-11-01) |" in get("eval/arithmetic/2026-11-02/report.md").decode()

    with serve(DEGRADED_MODEL) as degraded:
        proc = run(degraded, "arithmetic", "2026-11-03")
    assert proc.returncode != 0, "a regression must fail the run"
    assert "eval regression in suite arithmetic" in proc.stdout + proc.stderr
    third = summary("arithmetic", "2026-11-03")
    assert third["regression"] and all(c["regression"] for c in third["comparisons"]), third
    assert third["interval"]["mean"] < second["interval"]["mean"] - 0.2
    html = get("eval/arithmetic/2026-11-03/report.html").decode()  # written before the gate failed
    assert "REGRESSION" in html and "Top regressed items" in html and "data:image/png;base64," in html
    history = [json.loads(x) for x in get("eval/arithmetic/history.jsonl").splitlines()]
    assert [(h["date"], h["regression"]) for h in history] == [
        ("2026-11-01", False), ("2026-11-02", False), ("2026-11-03", True)]
    # ...and the regression reached Prometheus' side: the pushed gauges and counter
    arith = {"job": "aibrix_eval", "model": SERVED, "suite": "arithmetic"}
    assert pushed(gateway, "aibrix_eval_regression", **arith) == 1
    assert pushed(gateway, "aibrix_eval_regressions_total", **arith) == 1
    assert pushed(gateway, "aibrix_eval_score", **arith) == third["interval"]["mean"]
    mc_pushed = pushed(gateway, "aibrix_eval_score", job="aibrix_eval", suite="multiple_choice")
    assert mc_pushed == mc["interval"]["mean"]
    # every request of the four nights' batches, whichever processes ran the shards
    assert pushed(gateway, "aibrix_driver_requests_total", job="aibrix_driver", outcome="completed") == 700
    # ...and each night's batch pushed its own gauges from its tasks (one group per batch)
    assert pushed(gateway, "aibrix_batch_phase", job="aibrix_batch", phase="completed") == 4
    assert pushed(gateway, "aibrix_batch_requests_completed", job="aibrix_batch") == 700
    assert pushed(gateway, "aibrix_batch_shards_done", job="aibrix_batch") == pushed(
        gateway, "aibrix_batch_shards", job="aibrix_batch")
