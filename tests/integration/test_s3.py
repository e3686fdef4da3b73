"""S3 storage and the DAG on s3:// URIs, against a real SeaweedFS server."""

from __future__ import annotations

import json
import re

import pytest

from aibrix_operators.storage import S3Storage, StorageError
from tests.integration.conftest import SERVED_NAME, chat_requests, dags_test, read_jsonl

pytestmark = pytest.mark.e2e

BUCKET = "batch-test"


@pytest.fixture(scope="module")
def bucket(s3_server):
    client = s3_server.client()
    if BUCKET not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
        client.create_bucket(Bucket=BUCKET)
    return BUCKET


def test_large_object_goes_up_as_multipart_and_streams_back(s3_server, bucket):
    storage = S3Storage(s3_server.client(), part_bytes=5 * 1024 * 1024)
    line = b'{"custom_id":"x","pad":"' + b"z" * 1000 + b'"}\n'
    uri = f"s3://{bucket}/multipart/big.jsonl"
    with storage.open_write(uri) as fh:
        for _ in range(12_000):  # ~12 MB: three parts of 5 MiB
            fh.write(line)
    head = s3_server.client().head_object(Bucket=bucket, Key="multipart/big.jsonl")
    assert head["ETag"].strip('"').endswith("-3"), head["ETag"]  # a real multipart ETag
    with storage.open_read(uri) as fh:
        assert sum(1 for got in fh if got == line) == 12_000
    assert storage.size(uri) == 12_000 * len(line)


def test_failed_write_publishes_nothing(s3_server, bucket):
    storage = S3Storage(s3_server.client(), part_bytes=5 * 1024 * 1024)
    uri = f"s3://{bucket}/aborted/never.jsonl"
    with pytest.raises(RuntimeError), storage.open_write(uri) as fh:
        fh.write(b"x" * (6 * 1024 * 1024))  # one part already uploaded
        raise RuntimeError("writer died")
    assert not storage.exists(uri)


def test_a_listing_after_a_key_returns_only_what_sorts_after_it(s3_server, bucket):
    storage = S3Storage(s3_server.client())
    uris = [f"s3://{bucket}/listing/seg-{i:06d}.jsonl" for i in range(5)]
    for uri in uris:
        storage.write_bytes(uri, b"{}\n")
    storage.write_bytes(f"s3://{bucket}/listing-other/seg-000009.jsonl", b"{}\n")  # same start
    assert storage.list(f"s3://{bucket}/listing") == uris
    assert storage.list(f"s3://{bucket}/listing", after=uris[2]) == uris[3:]
    assert storage.list(f"s3://{bucket}/listing", after=uris[-1]) == []
    with pytest.raises(StorageError, match="not an object under it"):
        storage.list(f"s3://{bucket}/listing", after=f"s3://{bucket}/elsewhere/x")


def test_wrong_credentials_are_a_clear_error(s3_server, bucket):
    import boto3

    bad = boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1",
                       aws_access_key_id="wrong", aws_secret_access_key="wrong")
    with pytest.raises(StorageError, match=rf"cannot read s3://{bucket}/x.jsonl: \w+"):
        S3Storage(bad).open_read(f"s3://{bucket}/x.jsonl")


def test_dag_reads_and_writes_s3_with_an_airflow_connection(
    vllm_chat, airflow_session_env, s3_server, bucket, tmp_path
):
    client = s3_server.client()
    requests = chat_requests(25)
    body = "".join(json.dumps(r) + "\n" for r in requests).encode()
    client.put_object(Bucket=bucket, Key="in/batch.jsonl", Body=body)
    conn = s3_server.airflow_connection()
    # Credentials reach the task only through the Airflow connection, not AWS_* variables.
    env = {**airflow_session_env, "AIRFLOW_CONN_BATCH_S3": json.dumps(conn)}
    proc = dags_test(env, {
        "input_uri": f"s3://{bucket}/in/batch.jsonl", "output_uri": f"s3://{bucket}/out/run1",
        "endpoint": vllm_chat.base_url, "aws_conn_id": "batch_s3", "requests_per_shard": 10,
        "model": SERVED_NAME,
    }, tmp_path)
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert s3_server.secret_key not in proc.stdout + proc.stderr

    def get(key: str) -> str:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read().decode()

    output = read_jsonl(get("out/run1/output.jsonl"))
    assert [r["custom_id"] for r in output] == [r["custom_id"] for r in requests]
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 8 for r in output)
    assert get("out/run1/errors.jsonl") == ""
    batch = json.loads(get("out/run1/batch.json"))
    assert batch["request_counts"] == {"total": 25, "completed": 25, "failed": 0}
    assert batch["output_file_id"] == f"s3://{bucket}/out/run1/output.jsonl"
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="out/run1/_work/")["Contents"]]
    assert sum("/shards/shard-" in k for k in keys) == 3
    # results/<shard>/<binding: the shard's content digest>/seg-<attempt>-<seq>.jsonl
    assert any(re.search(r"/results/shard-00002/[0-9a-f]{24}/seg-", k) for k in keys)
