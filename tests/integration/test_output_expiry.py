"""Outputs that expire, through Airflow (issue 40): a batch that asks for ``output_expires_after``
gets its instant in ``batch.json`` and an expiry record from merge; the cleanup DAG
(``aibrix_output_cleanup``, `airflow dags test`) deletes a due batch's output and error files on S3
(SeaweedFS) and keeps the batch that is not due, and its own ``batch.json``."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from aibrix_operators.batch.output_expiry import ExpiryRecord, write_record
from aibrix_operators.localenv import REPO_ROOT
from aibrix_operators.storage import LocalStorage
from tests.integration.conftest import DAGS_TEST, SERVED_NAME, TEST_BUCKET, chat_requests, dags_test

pytestmark = pytest.mark.e2e

HOUR = 3600


def cleanup_dag(env: dict[str, str], log_dir: Path) -> subprocess.CompletedProcess:
    argv = ["dags", "test", "aibrix_output_cleanup", "-f", str(REPO_ROOT / "dags" / "output_cleanup.py")]
    proc = DAGS_TEST.run(argv, env, log_dir / "cleanup", timeout_s=600)
    (log_dir / "cleanup.log").write_text(proc.stdout + proc.stderr)
    return proc


def test_expired_outputs_are_deleted_on_s3_and_the_rest_kept(fake, airflow_session_env, s3_server, tmp_path):
    s3 = s3_server.ensure_bucket(TEST_BUCKET)
    prefix = f"expiry-{uuid.uuid4().hex[:8]}"
    conn = s3_server.airflow_connection()
    index = tmp_path / "state" / "expiring"
    env = {**airflow_session_env, "AIRFLOW_CONN_BATCH_S3": json.dumps(conn),
           "AIRFLOW__AIBRIX_BATCH__STATE_ROOT": str(tmp_path / "state")}

    def run_batch(name: str) -> dict:
        body = b"".join(json.dumps(r).encode() + b"\n" for r in chat_requests(5))
        s3.put_object(Bucket=TEST_BUCKET, Key=f"{prefix}/{name}/in.jsonl", Body=body)
        proc = dags_test(env, {"input_uri": f"s3://{TEST_BUCKET}/{prefix}/{name}/in.jsonl",
                               "output_uri": f"s3://{TEST_BUCKET}/{prefix}/{name}/out", "endpoint": fake.url,
                               "model": SERVED_NAME, "aws_conn_id": "batch_s3",
                               "output_expires_after": {"anchor": "created_at", "seconds": HOUR}},
                         tmp_path / name)
        assert proc.returncode == 0, proc.stdout[-4000:]
        published = s3.get_object(Bucket=TEST_BUCKET, Key=f"{prefix}/{name}/out/batch.json")
        return json.loads(published["Body"].read())

    first, second = run_batch("first"), run_batch("second")
    for batch in (first, second):
        # The files were created at merge's end; they expire an hour later, recorded for the sweep.
        assert batch["status"] == "completed"
        assert batch["aibrix_output_expires_at"] - HOUR >= batch["finalizing_at"]
        assert batch["aibrix_output_expires_at"] - HOUR <= batch["completed_at"] + 1
    records = {ExpiryRecord.from_bytes(p.read_bytes()).batch_id: p for p in index.iterdir()}
    assert set(records) == {first["id"], second["id"]}
    second_record = ExpiryRecord.from_bytes(records[second["id"]].read_bytes())
    assert second_record.expires_at == second["aibrix_output_expires_at"]
    assert second_record.aws_conn_id == "batch_s3"
    assert second_record.uris == (f"s3://{TEST_BUCKET}/{prefix}/second/out/output.jsonl",
                                  f"s3://{TEST_BUCKET}/{prefix}/second/out/errors.jsonl")
    # An hour passes for the second batch only: its record, as merge wrote it, but due now.
    records[second["id"]].unlink()
    write_record(LocalStorage(), str(index), ExpiryRecord(second_record.batch_id, int(time.time()) - 1,
                                                          second_record.uris, second_record.aws_conn_id))

    proc = cleanup_dag(env, tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]

    def keys(name: str) -> set[str]:
        listed = s3.list_objects_v2(Bucket=TEST_BUCKET, Prefix=f"{prefix}/{name}/out/").get("Contents", [])
        return {o["Key"].rsplit("/", 1)[-1] for o in listed}

    assert "output.jsonl" not in keys("second") and "batch.json" in keys("second")
    assert {"output.jsonl", "batch.json"} <= keys("first")  # not due: kept
    assert [p.name for p in index.iterdir()] == [records[first["id"]].name]
