"""The S3 drop zone end to end: a running Airflow (api-server, scheduler, dag-processor,
triggerer), SeaweedFS and a vLLM CPU server. Files dropped into the inbox become batch_inference
runs by themselves; seeing a file again or re-uploading its content starts nothing."""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from aibrix_operators.dropzone.core import DropZone, InboxObject
from aibrix_operators.local_airflow import start_airflow
from tests.integration.conftest import SERVED_NAME, TEST_BUCKET, chat_requests, read_jsonl

pytestmark = pytest.mark.e2e

ZONE = DropZone.parse(f"s3://{TEST_BUCKET}/dropzone/inbox/", f"s3://{TEST_BUCKET}/dropzone/outbox/")
PREFIX = "dropzone/"


@pytest.fixture
def airflow(airflow_session_env, s3_server, vllm_chat, tmp_path_factory):
    s3_server.ensure_bucket(TEST_BUCKET)
    home = tmp_path_factory.mktemp("airflow-dropzone")
    conn = s3_server.airflow_connection()
    env = {
        **airflow_session_env, "AIRFLOW_HOME": str(home),
        "AIRFLOW_CONN_BATCH_S3": json.dumps(conn),
        # The deployment's drop-zone settings, the way a deployment sets them.
        "AIRFLOW__AIBRIX_DROPZONE__INBOX": ZONE.inbox,
        "AIRFLOW__AIBRIX_DROPZONE__OUTBOX": ZONE.outbox,
        "AIRFLOW__AIBRIX_DROPZONE__AWS_CONN_ID": "batch_s3",
        "AIRFLOW__AIBRIX_DROPZONE__DAG_CONF": json.dumps({
            "endpoint": vllm_chat.base_url, "model": SERVED_NAME, "requests_per_shard": 5}),
        "AIRFLOW__AIBRIX_DROPZONE__POLL_INTERVAL_S": "1",
    }
    with start_airflow(env, home) as deployment:
        yield deployment


def _key(uri: str) -> str:
    return uri[len(f"s3://{TEST_BUCKET}/"):]


def _wait(what: str, check, timeout_s: float = 420):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1)
    raise TimeoutError(f"{what} not seen after {timeout_s}s")


def test_drops_become_batches_once(airflow, s3_server):
    s3 = s3_server.client()

    def get(uri: str) -> bytes | None:
        try:
            return s3.get_object(Bucket=TEST_BUCKET, Key=_key(uri))["Body"].read()
        except s3.exceptions.NoSuchKey:
            return None

    requests = chat_requests(12)
    good = "".join(json.dumps(r) + "\n" for r in requests).encode()
    s3.put_object(Bucket=TEST_BUCKET, Key=_key(ZONE.inbox) + "good.jsonl", Body=good)
    s3.put_object(Bucket=TEST_BUCKET, Key=_key(ZONE.inbox) + "team/bad.jsonl", Body=b"not json\n")
    token = airflow.token()
    for dag_id in ("batch_inference", "s3_dropzone"):
        airflow.unpause(dag_id, token=token)

    # 1. Both drops end up as results under outbox/<name>/, by themselves.
    good_out, bad_out = ZONE.output_uri("good.jsonl"), ZONE.output_uri("team/bad.jsonl")
    batch = json.loads(_wait("good.jsonl's batch.json", lambda: get(good_out + "/batch.json")))
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    assert batch["metadata"]["dropzone_sha256"] == hashlib.sha256(good).hexdigest()
    output = read_jsonl(get(good_out + "/output.jsonl").decode())
    assert [r["custom_id"] for r in output] == [r["custom_id"] for r in requests]  # every id answered
    assert get(good_out + "/errors.jsonl") == b""
    bad = json.loads(_wait("bad.jsonl's batch.json", lambda: get(bad_out + "/batch.json")))
    assert bad["status"] == "failed"
    assert bad["errors"]["data"][0]["code"] == "invalid_json_line" and bad["errors"]["data"][0]["line"] == 1
    assert get(ZONE.inbox + "team/bad.jsonl") == b"not json\n"  # nothing lost

    # 2. The same file seen again (its seen marker lost, e.g. a second drop zone deployment),
    #    and its content re-uploaded twice (single PUT: same ETag; multipart: another ETag).
    first = InboxObject("good.jsonl", hashlib.md5(good).hexdigest(), len(good))  # noqa: S324 - S3's ETag
    s3.delete_object(Bucket=TEST_BUCKET, Key=_key(ZONE.seen_uri(first)))
    _wait("good.jsonl seen again", lambda: get(ZONE.seen_uri(first)), 180)
    assert "duplicate_of" in json.loads(get(ZONE.seen_uri(first)))
    s3.put_object(Bucket=TEST_BUCKET, Key=_key(ZONE.inbox) + "good.jsonl", Body=good)
    key = _key(ZONE.inbox) + "good.jsonl"
    upload = s3.create_multipart_upload(Bucket=TEST_BUCKET, Key=key)["UploadId"]
    part = s3.upload_part(Bucket=TEST_BUCKET, Key=key, UploadId=upload, PartNumber=1, Body=good)
    s3.complete_multipart_upload(Bucket=TEST_BUCKET, Key=key, UploadId=upload,
                                 MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]})
    etag = s3.head_object(Bucket=TEST_BUCKET, Key=key)["ETag"].strip('"')
    assert etag != first.etag
    reupload = InboxObject("good.jsonl", etag, len(good))
    marker = json.loads(_wait("the multipart re-upload seen", lambda: get(ZONE.seen_uri(reupload)), 180))
    assert marker["duplicate_of"].startswith("dropzone__good.jsonl__")

    # Exactly one batch per file: no run started for what was seen again or re-uploaded.
    runs = airflow.api("GET", "/api/v2/dags/batch_inference/dagRuns?limit=100", token=token)["dag_runs"]
    assert sorted(r["dag_run_id"].split("__")[1] for r in runs) == ["good.jsonl", "team-bad.jsonl"]
    assert marker["duplicate_of"] in {r["dag_run_id"] for r in runs}
    watch = airflow.api("GET", "/api/v2/dags/s3_dropzone/dagRuns?limit=100", token=token)["dag_runs"]
    assert len(watch) >= 3, watch  # the first drops, the lost marker, the re-upload: separate runs
