"""Bodies against the Batch API app in-process (issue 19, findings 7 and 8): no key, no body
read; every body bounded, chunked or not; an upload's form parts bounded. Each test counts
the bytes the app actually pulled from the client, and a well-formed request still works."""

from __future__ import annotations

import json

import httpx
import pytest

from aibrix_operators.batch_api.app import ApiContext, create_app
from aibrix_operators.batch_api.auth import key_digest
from aibrix_operators.batch_api.request_limits import MAX_JSON_BYTES
from aibrix_operators.batch_api.settings import ApiSettings
from aibrix_operators.storage import LocalStorage

KEY = "sk-limits-test"
MIB = 1 << 20


class Body:
    """A streamed (chunked: no Content-Length) request body that counts what was pulled."""

    def __init__(self, chunks: int, chunk: bytes = b"x" * MIB, head: bytes = b"") -> None:
        self.chunks, self.chunk, self.head, self.pulled = chunks, chunk, head, 0

    async def __aiter__(self):
        if self.head:
            self.pulled += len(self.head)
            yield self.head
        for _ in range(self.chunks):
            self.pulled += len(self.chunk)
            yield self.chunk


@pytest.fixture
def client(tmp_path):
    settings = ApiSettings(storage_root=str(tmp_path / "api"), max_file_bytes=4 * MIB)
    app = create_app(lambda: ApiContext(settings, LocalStorage(), lambda: {key_digest(KEY): "alpha"}))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api")


AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}


async def test_a_keyless_body_is_refused_before_it_is_read(client):
    body = Body(256)  # 256 MiB, never sent in full
    resp = await client.post("/v1/batches", content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 401 and resp.json()["error"]["type"]
    assert body.pulled <= MIB  # at most the first chunk the transport handed over
    upload = Body(256)
    resp = await client.post("/v1/files", content=upload, headers={"Authorization": "Bearer sk-wrong"})
    assert resp.status_code == 401 and upload.pulled <= MIB


async def test_json_bodies_are_bounded_declared_or_chunked(client):
    chunked = Body(8)
    resp = await client.post("/v1/batches", content=chunked, headers=JSON)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    assert chunked.pulled <= MAX_JSON_BYTES + MIB
    declared = b"{" + b" " * (2 * MIB) + b"}"
    resp = await client.post("/v1/batches", content=declared, headers=JSON)
    assert resp.status_code == 413
    # A well-formed body still reaches the route (and fails there for its own reason: no such file).
    ok = {"input_file_id": "file-" + "0" * 32, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    resp = await client.post("/v1/batches", json=ok, headers=AUTH)
    assert resp.status_code == 404, resp.text
    # The error names the parameter the client sent (found by AIBrix's tests: it said "id").
    assert resp.json()["error"]["param"] == "input_file_id" and resp.json()["error"]["code"] == "not_found"


def multipart(fields: int, file_bytes: bytes = b'{"custom_id": "a"}\n') -> tuple[bytes, str]:
    boundary = "limits-boundary"
    field = '--{b}\r\nContent-Disposition: form-data; name="f{i}"\r\n\r\nv\r\n'
    parts = [field.format(b=boundary, i=i) for i in range(fields)]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n')
    head = "".join(parts).encode()
    file_part = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
                 "Content-Type: application/octet-stream\r\n\r\n").encode() + file_bytes
    return head + file_part + f"\r\n--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


async def test_upload_form_parts_and_total_bytes_are_bounded(client):
    body, ctype = multipart(1_000_000)  # a million tiny fields beside a tiny file: 60 MB in all
    resp = await client.post("/v1/files", content=body, headers={**AUTH, "Content-Type": ctype})
    assert resp.status_code == 413  # the whole body counts, not only the file part
    body, ctype = multipart(30_000)  # under the byte limit, but 30,000 parts
    streamed = Body(0, head=body)
    resp = await client.post("/v1/files", content=streamed, headers={**AUTH, "Content-Type": ctype})
    assert resp.status_code == 400 and "at most 16 form parts" in resp.json()["error"]["message"]
    # Chunked, so no Content-Length pre-check: counted as it streams, refused past the limit.
    head, ctype = multipart(0, b"")
    big = Body(64, chunk=b'{"custom_id": "x"}\n' * 50_000, head=head[: -len("\r\n--limits-boundary--\r\n")])
    resp = await client.post("/v1/files", content=big, headers={**AUTH, "Content-Type": ctype})
    assert resp.status_code == 413 and big.pulled < 8 * MIB
    listed = await client.get("/v1/files", headers=AUTH)
    assert listed.json()["data"] == []  # nothing was published
    body, ctype = multipart(0)  # the well-formed upload succeeds
    resp = await client.post("/v1/files", content=body, headers={**AUTH, "Content-Type": ctype})
    assert resp.status_code == 200 and json.loads(resp.text)["filename"] == "in.jsonl"
