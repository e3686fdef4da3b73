"""``AIBrixBatchOperator`` in a user's DAG (examples/dags/batch_operator_example.py), run by
``airflow dags test`` (its trigger runs in the same process), against OpenAI's Batch API as the
fake OpenAI server serves it: no Idempotency-Key, so re-attaching is the operator's own doing."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest

from tests.fake_openai import FakeOpenAI
from tests.integration.conftest import DAGS_TEST, SERVED_NAME, chat_requests, write_jsonl

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DAG_FILE = REPO / "examples" / "dags" / "batch_operator_example.py"
KEY = "sk-operator-test"


@pytest.fixture(scope="module")
def user_env(airflow_session_env, tmp_path_factory) -> dict[str, str]:
    """A user's deployment: its own DAGs folder (the example's) and its own copy of the
    session's migrated database, so the example's DAG never mixes with batch_inference's."""
    home = tmp_path_factory.mktemp("airflow-user-dags")
    shutil.copy(Path(airflow_session_env["AIRFLOW_HOME"]) / "airflow.db", home / "airflow.db")
    return {**airflow_session_env, "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(DAG_FILE.parent)}


@pytest.fixture
def fake(fake: FakeOpenAI) -> FakeOpenAI:
    fake.batches.key = KEY  # its Batch API wants this key (the connection's)
    return fake


def run_example(env: dict[str, str], fake: FakeOpenAI, conf: dict, log: Path) -> subprocess.CompletedProcess:
    connection = {"conn_type": "aibrix_batch", "host": fake.url + "/v1", "password": KEY}
    argv = ["dags", "test", "batch_operator_example", "-f", str(DAG_FILE), "-c", json.dumps(conf)]
    proc = DAGS_TEST.run(argv, {**env, "AIRFLOW_CONN_AIBRIX_BATCH_DEFAULT": json.dumps(connection)},
                         log.parent / log.stem, timeout_s=600)
    log.write_text(proc.stdout + proc.stderr)
    return proc


def asset_events(env: dict[str, str]) -> list[dict]:
    with sqlite3.connect(Path(env["AIRFLOW_HOME"]) / "airflow.db") as conn:
        rows = conn.execute("SELECT e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id "
                            "WHERE a.name = 'aibrix_batch_example_answers' ORDER BY e.id").fetchall()
    return [json.loads(r[0]) for r in rows]


def test_a_lost_create_answer_is_re_attached_not_sent_again(fake, user_env, tmp_path):
    """The first try's create reaches the service but its answer is lost: the try fails, and the
    retry finds the batch by the task's key and waits for it instead of submitting again. The
    result reaches the next task through XCom, and the Asset's event carries it."""
    requests = chat_requests(12)
    input_file = write_jsonl(tmp_path / "input.jsonl", requests)
    report = tmp_path / "report.json"
    fake.batches.drop_create_responses = 1
    before = len(asset_events(user_env))

    proc = run_example(user_env, fake, {"input_file": str(input_file), "model": SERVED_NAME,
                                        "report": str(report), "stop_rules": {"max_error_rate": 0.5}},
                       tmp_path / "dags-test.log")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert len(fake.batches.creates) == 1, fake.batches.creates  # one batch, whatever the tries
    # The DAG's stop rules reach the API as its extension (checked by the client first).
    assert fake.batches.creates[0]["stop_rules"] == {"max_error_rate": 0.5, "error_rate_min_sample": 100,
                                                     "max_total_tokens": None}
    assert len(fake.batches.files) == 2  # the input once, the output once
    assert "re-attaching to batch batch_000001" in proc.stdout + proc.stderr

    result = json.loads(report.read_text())["result"]
    assert result["batch_id"] == "batch_000001" and result["status"] == "completed"
    assert result["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    assert result["output_uri"] == f"{fake.url}/v1/files/{result['output_file_id']}/content"
    assert result["metadata"]["team"] == "examples" and result["metadata"]["airflow_task_key"]
    output = [json.loads(x) for x in fake.batches.contents[result["output_file_id"]].splitlines()]
    assert [r["custom_id"] for r in output] == [r["custom_id"] for r in requests]

    events = asset_events(user_env)[before:]
    assert len(events) == 1 and events[0]["batch_id"] == "batch_000001", events
    assert events[0]["request_counts"]["completed"] == 12


def test_a_failed_batch_fails_the_task_with_its_errors_not_retried(fake, user_env, tmp_path):
    requests = chat_requests(3, model="no-such-model")
    input_file = write_jsonl(tmp_path / "input.jsonl", requests)
    fake.batches.unknown_models = {"no-such-model"}

    proc = run_example(user_env, fake, {"input_file": str(input_file), "model": "no-such-model"},
                       tmp_path / "dags-test.log")
    out = proc.stdout + proc.stderr
    assert "batch batch_000001 ended failed: 0 of 3 requests completed" in out, out[-4000:]
    assert "model_not_found (line 1): The model 'no-such-model' does not exist" in out
    # The batch's own failure: no retry, so no second batch (the task has retries=2).
    assert len(fake.batches.creates) == 1
