"""Upload helpers the Batch API's file-store tests share (tests/unit/test_batch_api.py on local
storage, tests/integration/test_batch_api_s3_store.py on S3): the same checks on either store."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from aibrix_operators.batch_api.errors import ApiError
from aibrix_operators.batch_api.files import FileStore


def multipart(data: bytes, name: str = "in.jsonl", purpose: str = "batch") -> tuple[bytes, str]:
    """An upload's multipart body and its content type, as an HTTP client sends them."""
    req = httpx.Request("POST", "http://x/", files={"file": (name, data)}, data={"purpose": purpose})
    return req.read(), req.headers["content-type"]


async def chunks(body: bytes, size: int = 7000) -> AsyncIterator[bytes]:
    """``body`` as the server receives it: in pieces (the default splits a small upload's parts)."""
    for i in range(0, len(body), size):
        yield body[i:i + size]


def assert_hidden_from(store: FileStore, tenant: str, file_id: str) -> None:
    """Another tenant's file is not found (404, not 403: its existence is not told) nor listed."""
    with pytest.raises(ApiError) as exc:
        store.get(tenant, file_id)
    assert exc.value.status == 404
    assert store.list(tenant, None, 10, "desc", None) == ([], False)
