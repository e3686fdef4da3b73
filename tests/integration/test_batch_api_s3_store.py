"""The Batch API's file store on a real S3 server (SeaweedFS): what a deployment with an
``s3://`` ``api_storage_root`` runs. The end-to-end SDK tests use a local root; these cover the
object-storage path of uploads (multipart, streamed), reads, listings and tenants."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from aibrix_operators.batch_api.errors import ApiError
from aibrix_operators.batch_api.files import FileStore
from aibrix_operators.batch_api.upload import receive_upload
from aibrix_operators.storage import MULTIPART_PART_BYTES, S3Storage
from tests.batch_api_uploads import assert_hidden_from, chunks, multipart
from tests.integration.conftest import TEST_BUCKET

pytestmark = pytest.mark.service


@pytest.fixture
def store(s3_server) -> tuple[FileStore, object, str]:
    client = s3_server.ensure_bucket(TEST_BUCKET)
    prefix = f"api-{uuid.uuid4().hex[:8]}"
    return FileStore(S3Storage(client), f"s3://{TEST_BUCKET}/{prefix}"), client, prefix


def _keys(client, prefix: str) -> list[str]:
    listed = client.list_objects_v2(Bucket=TEST_BUCKET, Prefix=prefix + "/")
    return sorted(o["Key"][len(prefix) + 1:] for o in listed.get("Contents", []))


def test_upload_is_streamed_in_parts_into_s3_and_read_back_whole(store) -> None:
    files, client, prefix = store
    # Over two multipart parts, so the upload really goes out as an S3 multipart upload.
    line = b'{"custom_id": "r%07d", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    payload = b"".join(line % i for i in range(2 * MULTIPART_PART_BYTES // len(line % 0) + 100))
    assert len(payload) > 2 * MULTIPART_PART_BYTES
    body, ctype = multipart(payload)
    stored = asyncio.run(receive_upload(chunks(body, 1 << 16), ctype, files, "alpha", 10**9))

    assert stored.bytes == len(payload)
    assert b"".join(files.open_content("alpha", stored.id)) == payload
    assert _keys(client, prefix) == [f"tenants/alpha/files/{stored.id}.json",
                                     f"tenants/alpha/files/{stored.id}.jsonl"]
    page, more = files.list("alpha", None, 10, "desc", None)
    assert [f.id for f in page] == [stored.id] and not more


def test_oversize_upload_publishes_nothing_in_s3(store) -> None:
    files, client, prefix = store
    payload = b'{"custom_id": "a"}\n' * 50_000
    body, ctype = multipart(payload)
    with pytest.raises(ApiError) as exc:
        asyncio.run(receive_upload(chunks(body, 1 << 16), ctype, files, "alpha", len(payload) - 1))
    assert exc.value.status == 413
    assert _keys(client, prefix) == []
    # No multipart upload left open behind the refusal either (it would hold storage).
    uploads = client.list_multipart_uploads(Bucket=TEST_BUCKET, Prefix=prefix + "/")
    assert uploads.get("Uploads", []) == []


def test_tenants_do_not_see_each_others_files_in_s3(store) -> None:
    files, _, _ = store
    body, ctype = multipart(b'{"custom_id": "a"}\n')
    stored = asyncio.run(receive_upload(chunks(body, 1 << 16), ctype, files, "alpha", 100))
    assert_hidden_from(files, "beta", stored.id)
    assert files.get("alpha", stored.id).bytes == len(b'{"custom_id": "a"}\n')
