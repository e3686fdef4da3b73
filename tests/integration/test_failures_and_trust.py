"""Every failure leaves a failed batch.json; a trigger cannot steer the worker's secrets or reach.

Real `airflow dags test` runs, a real SeaweedFS with scoped identities, and real
HTTP servers that record what reaches them. No vLLM: these runs fail (or are
answered) before a model is needed.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from aibrix_operators.localenv import WORK_DIR
from tests.client.batch_api_stub import send_json
from tests.integration.conftest import (
    TEST_BUCKET,
    TEST_INFERENCE_CONN,
    chat_requests,
    dags_test,
    read_jsonl,
    write_jsonl,
)
from tests.integration.services import start_seaweedfs, stop_group

pytestmark = pytest.mark.e2e

PLANTED = "sk-planted-7f3c9a1e5b"        # the inference connection's password
PLANTED_ENV = "sk-worker-env-44d0b2c8a6"  # a key in the worker's own environment


# ---------------------------------------------------------------------------- a recording server


class Recorder:
    """An OpenAI-compatible stub that records every request's method, path and headers."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _record(self) -> bytes:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                recorder.requests.append((self.command, self.path, dict(self.headers)))
                return body

            def _send(self, status: int, payload: dict) -> None:
                send_json(self, status, payload)

            def do_GET(self) -> None:  # noqa: N802
                self._record()
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": "tiny-llama", "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self._record() or b"{}")
                self._send(200, {
                    "id": "chatcmpl-rec", "object": "chat.completion", "created": 1,
                    "model": body.get("model"),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                })

            do_PUT = do_POST  # noqa: N815 - an S3 client would PUT; record it all the same
            do_HEAD = do_GET  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recorders():
    made: list[Recorder] = []

    def make() -> Recorder:
        made.append(Recorder())
        return made[-1]

    yield make
    for r in made:
        r.close()


def _failed_batch(out: Path) -> dict:
    batch = json.loads((out / "batch.json").read_text())
    assert batch["status"] == "failed", batch
    assert batch["failed_at"] >= batch["created_at"]
    for error in batch["errors"]["data"]:
        assert "Traceback" not in error["message"] and "\n" not in error["message"]
    return batch


def _codes(batch: dict) -> list[str]:
    return [e["code"] for e in batch["errors"]["data"]]


# ---------------------------------------------------------------------------- item 4: failures


def test_missing_input_and_bad_window_leave_a_failed_batch_json(airflow_session_env, tmp_path):
    out = tmp_path / "out-missing"
    proc = dags_test(airflow_session_env, {
        "input_uri": str(tmp_path / "no-such.jsonl"), "output_uri": str(out),
    }, tmp_path / "missing")
    assert proc.returncode != 0
    batch = _failed_batch(out)
    assert _codes(batch) == ["input_not_found"]
    assert "no-such.jsonl" in batch["errors"]["data"][0]["message"]
    log = proc.stdout + proc.stderr
    assert "[input_not_found]" in log and f"recorded in {out}/batch.json" in log
    # record_failure says where the record is, not a made-up one.
    assert "the batch failed in validation; the failed batch is recorded in" in log

    # "0h" passes the form's pattern but is not a usable window; checked before reading.
    input_path = write_jsonl(tmp_path / "in.jsonl", chat_requests(2))
    out = tmp_path / "out-window"
    proc = dags_test(airflow_session_env, {
        "input_uri": str(input_path), "output_uri": str(out), "completion_window": "0h",
    }, tmp_path / "window")
    assert proc.returncode != 0
    batch = _failed_batch(out)
    assert _codes(batch) == ["invalid_completion_window"]
    assert batch["errors"]["data"][0]["param"] == "completion_window"
    assert not (out / "_work").exists()


def test_default_output_is_a_directory_of_the_run(airflow_session_env, tmp_path):
    proc = dags_test(airflow_session_env, {"input_uri": str(tmp_path / "absent.jsonl")}, tmp_path)
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    marker = "the failed batch is recorded in "
    where = Path(log[log.index(marker) + len(marker):].split()[0])
    try:
        assert where.name == "batch.json"
        assert where.parent.parent == WORK_DIR / "outputs"
        assert where.parent.name.startswith("manual__") and where.parent.name != "latest"
        assert _codes(_failed_batch(where.parent)) == ["input_not_found"]
    finally:
        shutil.rmtree(where.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def scoped_s3(tmp_path_factory):
    """SeaweedFS with an admin and an identity that may only use the output bucket."""
    root = tmp_path_factory.mktemp("seaweed-scoped")
    config = root / "s3.json"
    config.write_text(json.dumps({"identities": [
        {"name": "admin", "credentials": [{"accessKey": "admin-key", "secretKey": "admin-secret"}],
         "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
        {"name": "writer", "credentials": [{"accessKey": "writer-key", "secretKey": "writer-secret"}],
         "actions": [f"Read:{TEST_BUCKET}", f"Write:{TEST_BUCKET}", f"List:{TEST_BUCKET}"]},
    ]}))
    server = start_seaweedfs(root / "data", "admin-key", "admin-secret", (f"-s3.config={config}",))
    client = server.client()
    for bucket in (TEST_BUCKET, "locked-inputs"):
        client.create_bucket(Bucket=bucket)
    body = "".join(json.dumps(r) + "\n" for r in chat_requests(3)).encode()
    client.put_object(Bucket="locked-inputs", Key="in.jsonl", Body=body)
    client.put_object(Bucket=TEST_BUCKET, Key="in.jsonl", Body=body)
    try:
        yield server
    finally:
        stop_group(server.proc)


def _s3_conn(server, key: str, secret: str) -> str:
    return json.dumps({"conn_type": "aws", "login": key, "password": secret,
                       "extra": {"endpoint_url": server.endpoint, "region_name": "us-east-1"}})


def test_bad_s3_credentials_are_a_specific_error(airflow_session_env, scoped_s3, tmp_path):
    env = {**airflow_session_env,
           "AIRFLOW__AIBRIX_BATCH__ALLOWED_STORAGE":
               airflow_session_env["AIRFLOW__AIBRIX_BATCH__ALLOWED_STORAGE"] + ",s3://locked-inputs/"}
    client = scoped_s3.client()

    # Credentials that may write the output but not read the input: the record lands.
    proc = dags_test({**env, "AIRFLOW_CONN_BATCH_S3": _s3_conn(scoped_s3, "writer-key", "writer-secret")}, {
        "input_uri": "s3://locked-inputs/in.jsonl", "output_uri": f"s3://{TEST_BUCKET}/out/denied",
        "aws_conn_id": "batch_s3",
    }, tmp_path / "denied")
    assert proc.returncode != 0
    batch = json.loads(client.get_object(Bucket=TEST_BUCKET, Key="out/denied/batch.json")["Body"].read())
    assert batch["status"] == "failed"
    assert _codes(batch) == ["input_access_denied"]
    assert "AccessDenied" in batch["errors"]["data"][0]["message"]
    assert "writer-secret" not in proc.stdout + proc.stderr

    # Wrong keys: nothing can be written either, and the log says exactly that.
    proc = dags_test({**env, "AIRFLOW_CONN_BATCH_S3": _s3_conn(scoped_s3, "writer-key", "wrong-secret")}, {
        "input_uri": f"s3://{TEST_BUCKET}/in.jsonl", "output_uri": f"s3://{TEST_BUCKET}/out/wrong",
        "aws_conn_id": "batch_s3",
    }, tmp_path / "wrong")
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    assert "[input_access_denied]" in log
    assert f"batch.json could not be written to s3://{TEST_BUCKET}/out/wrong/batch.json: " in log
    assert "SignatureDoesNotMatch" in log or "InvalidAccessKeyId" in log
    assert "wrong-secret" not in log
    assert client.list_objects_v2(Bucket=TEST_BUCKET, Prefix="out/wrong/").get("KeyCount", 0) == 0


# ---------------------------------------------------------------------------- item 5: trust


def _grep_secret(secret: str, *roots: Path) -> list[str]:
    hits = []
    for root in roots:
        for path in [root] if root.is_file() else root.rglob("*"):
            if path.is_file() and secret.encode() in path.read_bytes():
                hits.append(str(path))
    return hits


def test_the_key_goes_only_to_the_connection_host(airflow_session_env, recorders, tmp_path):
    trusted, foreign = recorders(), recorders()
    conn = {"conn_type": "http", "host": "127.0.0.1", "port": int(trusted.url.rsplit(":", 1)[1]),
            "schema": "http", "password": PLANTED}
    env = {**airflow_session_env, f"AIRFLOW_CONN_{TEST_INFERENCE_CONN.upper()}": json.dumps(conn),
           "OPENAI_API_KEY": PLANTED_ENV, "OPENAI_API_KEY_ORIGIN": foreign.url}
    requests = chat_requests(4)
    input_path = write_jsonl(tmp_path / "in.jsonl", requests)

    out_conn = tmp_path / "out-conn"
    proc_conn = dags_test(env, {"input_uri": str(input_path), "output_uri": str(out_conn),
                                "inference_conn_id": TEST_INFERENCE_CONN}, tmp_path / "conn")
    assert proc_conn.returncode == 0, proc_conn.stdout[-4000:]
    posts = [h for m, _, h in trusted.requests if m == "POST"]
    assert len(posts) == 4
    assert all(h.get("Authorization") == f"Bearer {PLANTED}" for _, _, h in trusted.requests)

    # A free-form endpoint (on the allow-list) gets the requests but no key of any kind,
    # even with the worker's own OPENAI_API_KEY set and "bound" to it.
    out_free = tmp_path / "out-free"
    proc_free = dags_test(env, {"input_uri": str(input_path), "output_uri": str(out_free),
                                "endpoint": foreign.url}, tmp_path / "free")
    assert proc_free.returncode == 0, proc_free.stdout[-4000:]
    assert len([1 for m, _, _ in foreign.requests if m == "POST"]) == 4
    assert all("Authorization" not in h and "authorization" not in h for _, _, h in foreign.requests)
    output = read_jsonl((out_free / "output.jsonl").read_text())
    assert [r["custom_id"] for r in output] == [r["custom_id"] for r in requests]

    # Naming the connection and another endpoint is refused before anything is read or sent.
    seen = len(foreign.requests)
    out_mixed = tmp_path / "out-mixed"
    proc_mixed = dags_test(env, {"input_uri": str(input_path), "output_uri": str(out_mixed),
                                 "inference_conn_id": TEST_INFERENCE_CONN, "endpoint": foreign.url},
                           tmp_path / "mixed")
    assert proc_mixed.returncode != 0
    assert len(foreign.requests) == seen
    batch = _failed_batch(out_mixed)
    assert _codes(batch) == ["refused_by_policy"]
    assert "inference_conn_id" in batch["errors"]["data"][0]["message"]

    # Neither key is anywhere: logs, XComs and rendered fields (the Airflow DB), outputs.
    logs = [proc.stdout + proc.stderr for proc in (proc_conn, proc_free, proc_mixed)]
    for secret in (PLANTED, PLANTED_ENV):
        assert not any(secret in text for text in logs)
        assert _grep_secret(secret, tmp_path, Path(airflow_session_env["AIRFLOW_HOME"])) == []


def _watch_fifo(path: Path, stop: threading.Event, opened: list[bool]) -> None:
    """Notice whether any process opens the FIFO for reading (a non-blocking writer open succeeds)."""
    while not stop.is_set():
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no reader has it open
                raise
            time.sleep(0.001)
            continue
        opened.append(True)
        os.close(fd)  # the reader sees end of file and goes on
        return


def test_a_trigger_outside_the_allow_list_is_refused_before_any_read(
    airflow_session_env, recorders, tmp_path
):
    outside = Path(tempfile.mkdtemp(prefix="aibrix-outside-"))  # not under the tests' allowed tmp root
    try:
        fifo = outside / "in.jsonl"
        os.mkfifo(fifo)
        stop, opened = threading.Event(), []
        watcher = threading.Thread(target=_watch_fifo, args=(fifo, stop, opened), daemon=True)
        watcher.start()
        out = tmp_path / "out-input"
        proc = dags_test(airflow_session_env, {"input_uri": str(fifo), "output_uri": str(out)},
                         tmp_path / "input")
        stop.set()
        watcher.join(5)
        assert proc.returncode != 0
        assert opened == [], "the input outside the allow-list was opened"
        batch = _failed_batch(out)  # the output is allowed, so the refusal is recorded there
        assert _codes(batch) == ["refused_by_policy"]
        assert "allowed_storage" in batch["errors"]["data"][0]["message"]
        assert "input_uri" in batch["errors"]["data"][0]["message"]

        # An output outside the list: nothing is created there; the log names the rule.
        input_path = write_jsonl(tmp_path / "in.jsonl", chat_requests(2))
        proc = dags_test(airflow_session_env, {"input_uri": str(input_path),
                                               "output_uri": str(outside / "out")}, tmp_path / "output")
        assert proc.returncode != 0
        log = proc.stdout + proc.stderr
        assert "refused by the allow-list rule allowed_storage: output_uri" in log
        assert "no batch.json was written" in log
        assert not (outside / "out").exists()
    finally:
        shutil.rmtree(outside, ignore_errors=True)

    # A connection outside the list is never used: its S3 endpoint (a recorder) hears nothing.
    s3_stub = recorders()
    rogue = json.dumps({"conn_type": "aws", "login": "k", "password": "s",
                        "extra": {"endpoint_url": s3_stub.url, "region_name": "us-east-1"}})
    env = {**airflow_session_env, "AIRFLOW_CONN_ROGUE_S3": rogue, "AIRFLOW_CONN_BATCH_S3": rogue}
    proc = dags_test(env, {"input_uri": f"s3://{TEST_BUCKET}/in.jsonl",
                           "output_uri": f"s3://{TEST_BUCKET}/out", "aws_conn_id": "rogue_s3"},
                     tmp_path / "conn")
    assert proc.returncode != 0
    assert "refused by the allow-list rule allowed_aws_conn_ids" in proc.stdout + proc.stderr
    assert s3_stub.requests == []
    # An allowed connection but a bucket outside the list: refused before the connection is used.
    proc = dags_test(env, {"input_uri": "s3://someone-elses-bucket/in.jsonl",
                           "output_uri": f"s3://{TEST_BUCKET}/out", "aws_conn_id": "batch_s3"},
                     tmp_path / "bucket")
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    assert "refused by the allow-list rule allowed_storage: input_uri 's3://someone-elses-bucket" in log
    # The refusal was recorded at the (allowed) output through the allowed connection: that is
    # the only traffic, a PUT of batch.json — no GET of the input.
    assert [(m, p) for m, p, _ in s3_stub.requests if m == "GET"] == []
    assert all(p.endswith("/out/batch.json") for _, p, _ in s3_stub.requests), s3_stub.requests


def test_a_failure_after_validation_records_the_steps_own_error(airflow_session_env, recorders, tmp_path):
    server = recorders()  # serves only "tiny-llama"
    input_path = write_jsonl(tmp_path / "in.jsonl", chat_requests(3, model="other-model"))
    out = tmp_path / "out"
    proc = dags_test(airflow_session_env, {"input_uri": str(input_path), "output_uri": str(out),
                                           "endpoint": server.url}, tmp_path)
    assert proc.returncode != 0
    batch = _failed_batch(out)
    assert _codes(batch) == ["model_not_served"]
    message = batch["errors"]["data"][0]["message"]
    assert message.startswith("dispatch[0]: ") and "'other-model' is not served at" in message
    assert batch["request_counts"]["total"] == 3
    assert [m for m, _, _ in server.requests if m == "POST"] == []
