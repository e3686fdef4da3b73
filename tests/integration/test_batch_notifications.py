"""A batch's end, told: batch_inference's Asset event (its extra the batch) and the deployment's
webhook (notifications/webhook.py), from `airflow dags test` against the fake OpenAI server and
a local HTTP server that records what it is sent."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.client.batch_api_stub import served_in_thread
from tests.integration.conftest import SERVED_NAME, chat_requests, dags_test, write_jsonl

pytestmark = pytest.mark.e2e

TOKEN = "webhook-token-for-the-test"


class Receiver(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.received: list[tuple[dict[str, str], dict]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hooks/batches"


class Handler(BaseHTTPRequestHandler):
    server: Receiver

    def log_message(self, *_: object) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.received.append(({k.lower(): v for k, v in self.headers.items()}, json.loads(body)))
        self.send_response(204)
        self.end_headers()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with served_in_thread(Receiver()) as server:
        yield server


def asset_events(env: dict[str, str], batch_id: str) -> list[dict]:
    with sqlite3.connect(Path(env["AIRFLOW_HOME"]) / "airflow.db") as conn:
        rows = conn.execute("SELECT e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id "
                            "WHERE a.name = 'aibrix_batch_inference_outputs'").fetchall()
    return [extra for extra in (json.loads(r[0]) for r in rows) if extra.get("batch_id") == batch_id]


def test_a_completed_batch_emits_its_asset_event_and_notifies_the_webhook(
        fake, receiver, airflow_session_env, tmp_path):
    requests = chat_requests(10)
    out = tmp_path / "out"
    env = {**airflow_session_env, "AIRFLOW__AIBRIX_BATCH__NOTIFY_WEBHOOK_URL": receiver.url,
           "AIRFLOW__AIBRIX_BATCH__NOTIFY_WEBHOOK_TOKEN": TOKEN}
    input_uri = str(write_jsonl(tmp_path / "in.jsonl", requests))
    proc = dags_test(env, {"input_uri": input_uri, "output_uri": str(out), "endpoint": fake.url,
                           "model": SERVED_NAME}, tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    batch = json.loads((out / "batch.json").read_text())
    assert batch["status"] == "completed"

    [(headers, message)] = receiver.received
    assert headers["authorization"] == f"Bearer {TOKEN}"
    assert message["batch_id"] == batch["id"] and message["status"] == "completed"
    assert message["request_counts"] == {"total": 10, "completed": 10, "failed": 0}
    assert message["output_uri"] == str(out) and message["error"] is None
    assert message["dag_id"] == "batch_inference" and message["usage"]["input_tokens"] > 0

    [extra] = asset_events(airflow_session_env, batch["id"])
    assert extra["status"] == "completed" and extra["output_uri"] == str(out)
    assert extra["model"] == SERVED_NAME and extra["request_counts"]["completed"] == 10


def test_a_failed_batch_notifies_the_webhook_with_its_error_and_emits_no_event(
        fake, receiver, airflow_session_env, tmp_path):
    requests = chat_requests(3)
    requests[1]["custom_id"] = requests[0]["custom_id"]  # a duplicate id: validation refuses the file
    out = tmp_path / "out"
    env = {**airflow_session_env, "AIRFLOW__AIBRIX_BATCH__NOTIFY_WEBHOOK_URL": receiver.url}
    input_uri = str(write_jsonl(tmp_path / "in.jsonl", requests))
    proc = dags_test(env, {"input_uri": input_uri, "output_uri": str(out), "endpoint": fake.url,
                           "model": SERVED_NAME}, tmp_path)
    batch = json.loads((out / "batch.json").read_text())
    assert batch["status"] == "failed", proc.stdout[-4000:]

    [(headers, message)] = receiver.received
    assert "authorization" not in headers  # no token set, none sent
    assert message["status"] == "failed" and message["output_uri"] == str(out)
    assert message["batch_id"] == batch["id"] and "failed in validation" in message["error"], message
    assert [e["code"] for e in message["errors"]] == [e["code"] for e in batch["errors"]["data"]][:5]
    assert "duplicate" in json.dumps(message["errors"]).lower(), message
    assert asset_events(airflow_session_env, batch["id"]) == []


def test_a_batch_stopped_by_its_error_rate_ends_failed_with_its_answers(
        fake, receiver, airflow_session_env, tmp_path):
    """Issue 40's stop rule through the DAG: the run's param reaches validate, the drivers stop the
    batch once most of its answers are the requests' own errors (a 400 for four lines in five), and
    merge publishes it failed with the rule's code, the answers so far in the output, the rest
    ``batch_stopped``; the webhook is told."""
    requests = chat_requests(1000)
    for i, request in enumerate(requests):
        request["body"]["fault"] = ["ok@0.02" if i % 5 == 0 else "400@0.02"]  # 100 answers a second
    out = tmp_path / "out"
    env = {**airflow_session_env, "AIRFLOW__AIBRIX_BATCH__NOTIFY_WEBHOOK_URL": receiver.url}
    input_uri = str(write_jsonl(tmp_path / "in.jsonl", requests))
    proc = dags_test(env, {"input_uri": input_uri, "output_uri": str(out), "endpoint": fake.url,
                           "model": SERVED_NAME, "concurrency": 2,
                           "stop_rules": {"max_error_rate": 0.5, "error_rate_min_sample": 50}}, tmp_path)
    batch = json.loads((out / "batch.json").read_text())
    assert batch["status"] == "failed", proc.stdout[-4000:]
    [error] = batch["errors"]["data"]
    assert error["code"] == "max_error_rate_exceeded", error
    answered = [json.loads(x) for x in (out / "output.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    stopped = [e for e in errors if e["error"]["code"] == "batch_stopped"]
    assert sorted(r["custom_id"] for r in answered + errors) == [r["custom_id"] for r in requests]
    assert len(stopped) > 500 and batch["aibrix_unanswered"] == len(stopped)  # it stopped early
    assert sum(fake.counts().values()) == 1000 - len(stopped)  # never sent, not sent and dropped
    [(_, message)] = receiver.received
    assert message["status"] == "failed" and message["batch_id"] == batch["id"]
