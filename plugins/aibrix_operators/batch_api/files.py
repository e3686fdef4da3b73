"""The tenants' files: uploaded batch inputs and the batches' registered outputs.

Layout under the deployment's storage root (no database: the objects are the record)::

    <root>/tenants/<tenant>/files/<file_id>.jsonl   uploaded content
    <root>/tenants/<tenant>/files/<file_id>.json    the File object, plus ``content_uri``
    <root>/tenants/<tenant>/batches/<batch_id>/     the DAG's output_uri for that batch

Every URI is built from a checked tenant name and a checked id (``ids``), so no
client text can point outside the tenant's prefix; a meta object whose
``content_uri`` is not under the tenant's prefix is treated as missing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from aibrix_operators.batch_api.errors import ApiError, not_found
from aibrix_operators.batch_api.ids import check_file_id, check_tenant
from aibrix_operators.storage import Storage, StorageError, delete_object, join_uri

META_SUFFIX = ".json"
CONTENT_SUFFIX = ".jsonl"
STREAM_CHUNK = 1 << 20


def tenant_prefix(root: str, tenant: str) -> str:
    return join_uri(root, "tenants", check_tenant(tenant))


def batch_output_uri(root: str, tenant: str, batch_id: str) -> str:
    return join_uri(tenant_prefix(root, tenant), "batches", batch_id)


@dataclass
class StoredFile:
    """A File object (OpenAI's fields) and where its bytes are."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    content_uri: str
    # A batch output that expires (output_expires_after, batch/output_expiry.py): from then on the
    # file is gone for the API (404), whether or not the cleanup task has deleted its bytes yet.
    expires_at: int | None = None

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": self.expires_at, "status_details": None}

    def expired(self) -> bool:
        return self.expires_at is not None and self.expires_at <= time.time()


class FileStore:
    def __init__(self, storage: Storage, root: str) -> None:
        self.storage = storage
        self.root = root.rstrip("/")

    def _dir(self, tenant: str) -> str:
        return join_uri(tenant_prefix(self.root, tenant), "files")

    def content_uri(self, tenant: str, file_id: str) -> str:
        return join_uri(self._dir(tenant), check_file_id(file_id) + CONTENT_SUFFIX)

    def _meta_uri(self, tenant: str, file_id: str) -> str:
        return join_uri(self._dir(tenant), check_file_id(file_id) + META_SUFFIX)

    def save_meta(self, tenant: str, stored: StoredFile) -> None:
        self._check_inside(tenant, stored.content_uri)
        self.storage.write_bytes(self._meta_uri(tenant, stored.id), json.dumps(stored.__dict__).encode())

    def get(self, tenant: str, file_id: str) -> StoredFile:
        uri = self._meta_uri(tenant, file_id)
        try:
            data = json.loads(self.storage.read_bytes(uri))
        except StorageError:
            raise not_found("file", file_id) from None
        stored = StoredFile(**data)
        if not self._inside(tenant, stored.content_uri) or stored.expired():
            raise not_found("file", file_id)
        return stored

    def exists(self, tenant: str, file_id: str) -> bool:
        return self.storage.exists(self._meta_uri(tenant, file_id))

    def list(self, tenant: str, after: str | None, limit: int, order: str,
             purpose: str | None) -> tuple[list[StoredFile], bool]:
        """One page of the tenant's files; ids sort by creation time, so no index is needed."""
        names = [u.rsplit("/", 1)[-1] for u in self.storage.list(self._dir(tenant))]
        ids = sorted((n[: -len(META_SUFFIX)] for n in names if n.endswith(META_SUFFIX)),
                     reverse=(order == "desc"))
        if after is not None:
            check_file_id(after, "after")
            ids = [i for i in ids if (i < after if order == "desc" else i > after)]
        page: list[StoredFile] = []
        has_more = False
        for file_id in ids:
            try:
                stored = self.get(tenant, file_id)
            except ApiError:
                continue  # deleted meanwhile
            if purpose and stored.purpose != purpose:
                continue
            if len(page) == limit:
                has_more = True
                break
            page.append(stored)
        return page, has_more

    def open_content(self, tenant: str, file_id: str) -> Iterator[bytes]:
        """The file's bytes in 1 MiB chunks (never the whole file in memory)."""
        stored = self.get(tenant, file_id)
        stream = self.storage.open_read(stored.content_uri)

        def chunks() -> Iterator[bytes]:
            with stream:
                while chunk := stream.read(STREAM_CHUNK):
                    yield chunk

        return chunks()

    def delete(self, tenant: str, file_id: str) -> None:
        stored = self.get(tenant, file_id)
        delete_object(self.storage, self._meta_uri(tenant, file_id))
        delete_object(self.storage, stored.content_uri)

    def _inside(self, tenant: str, uri: str) -> bool:
        prefix = tenant_prefix(self.root, tenant) + "/"
        if "/../" in uri or uri.endswith("/..") or "\\" in uri:
            return False
        return uri.startswith(prefix)

    def _check_inside(self, tenant: str, uri: str) -> None:
        if not self._inside(tenant, uri):
            raise ValueError(f"{uri} is outside tenant {tenant}'s prefix")


def now() -> int:
    return int(time.time())
