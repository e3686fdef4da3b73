"""AIBrixBatchOperator's checks before it sends anything, its re-attach look-up and its failure
summary, against the fake OpenAI server's Batch API (a thread of this process)."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException

from aibrix_operators.client.batch_client import BatchClient
from aibrix_operators.operators.batch_api import (
    TASK_KEY,
    AIBrixBatchOperator,
    check_first_model,
    failure_summary,
    find_batch,
)
from tests.driver.conftest import fault_server  # noqa: F401 - fixture
from tests.fake_openai import FakeOpenAI

LINE = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}


@pytest.fixture
def fake(fault_server: FakeOpenAI) -> FakeOpenAI:  # noqa: F811 - the imported fixture
    """The driver tests' fake OpenAI server: its Batch API is what these tests talk to."""
    return fault_server


def client(fake: FakeOpenAI) -> BatchClient:
    return BatchClient(fake.url + "/v1", "sk-any", max_retries=0)


def test_the_first_line_must_name_the_tasks_model() -> None:
    check_first_model(json.dumps(LINE).encode(), "m", "input_file")
    with pytest.raises(AirflowFailException, match="line 1 asks for model 'm', the task for 'other'"):
        check_first_model(json.dumps(LINE).encode(), "other", "input_file")
    with pytest.raises(AirflowFailException, match="input_uri: line 1 is not a batch request"):
        check_first_model(b"not json", "m", "input_uri")


def test_an_input_outside_the_allow_list_sends_nothing(fake, tmp_path: Path, monkeypatch) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "in.jsonl").write_text(json.dumps(LINE) + "\n")
    (tmp_path / "elsewhere.jsonl").write_text(json.dumps(LINE) + "\n")
    monkeypatch.setenv("AIRFLOW__AIBRIX_BATCH__ALLOWED_STORAGE", str(allowed))
    outside = AIBrixBatchOperator(task_id="t", input_file=str(tmp_path / "elsewhere.jsonl"))
    refused = "refused by the allow-list rule allowed_storage: input_file"
    with pytest.raises(AirflowFailException, match=refused):
        outside._submit(client(fake), "key", "key-try1")
    assert fake.batches.files == {} and fake.batches.creates == []
    # The same file under the allowed folder goes: uploaded once, created once, with the key.
    inside = AIBrixBatchOperator(task_id="t", input_file=str(allowed / "in.jsonl"), metadata={"team": "x"})
    batch = inside._submit(client(fake), "key", "key-try1")
    assert len(fake.batches.files) == 1 and batch.metadata == {"team": "x", TASK_KEY: "key"}


def test_the_look_up_finds_the_tasks_newest_batch_and_stops_at_the_runs_start(fake) -> None:
    c = client(fake)
    file_id = c.upload(io.BytesIO(json.dumps(LINE).encode())).id
    for key in ("mine", "other", "mine", "other"):
        c.create_batch(input_file_id=file_id, endpoint="/v1/chat/completions", metadata={TASK_KEY: key})
    now = datetime.now(UTC)
    assert find_batch(c, "mine", now - timedelta(minutes=5)).id == "batch_000003"
    assert find_batch(c, "nobody", now - timedelta(minutes=5)) is None
    # Batches created before the run started are not the task's, whatever their key.
    assert find_batch(c, "mine", now + timedelta(minutes=5)) is None


def test_a_failed_batchs_summary_names_counts_and_errors() -> None:
    errors = [{"code": "model_not_found", "line": n, "message": f"no model on line {n}"} for n in range(1, 8)]
    text = failure_summary({"id": "batch_1", "status": "failed", "request_counts": {"total": 7},
                            "errors": {"data": errors}, "error_file_id": None})
    assert text.startswith("batch batch_1 ended failed: 0 of 7 requests completed, 0 failed; errors: ")
    assert "model_not_found (line 5): no model on line 5" in text and "line 6" not in text
    assert text.endswith("and 2 more")
