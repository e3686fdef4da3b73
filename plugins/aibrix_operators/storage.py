"""Read and write batch files by URI: local paths and ``s3://bucket/key``.

Everything streams: readers are buffered streams with ``readline``; writers
buffer at most one multipart part (8 MiB) and publish the object only when
closed without an error, so a reader never sees half a file. S3 credentials and
the endpoint come from boto3's usual sources (``AWS_ACCESS_KEY_ID``,
``AWS_ENDPOINT_URL``, ...), or from a client built by the caller (the Airflow
layer builds one from an Airflow connection).
"""

from __future__ import annotations

import io
import os
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from aibrix_operators.batch.error_codes import BatchFailure, CodedFailure

MULTIPART_PART_BYTES = 8 * 1024 * 1024
READ_BUFFER_BYTES = 1024 * 1024


class StorageError(CodedFailure):
    """A storage operation failed; the message names the URI and the cause."""

    error_code, retryable = BatchFailure.STORAGE_ERROR, True


class Storage(Protocol):
    def open_read(self, uri: str) -> BinaryIO: ...

    def open_write(self, uri: str) -> Any: ...

    def write_bytes(self, uri: str, data: bytes) -> None: ...

    def read_bytes(self, uri: str) -> bytes: ...

    def list(self, prefix_uri: str, after: str | None = None) -> list[str]:
        """The objects under a prefix, sorted; with ``after`` (a URI under it), only those
        that sort after it (S3's ``StartAfter``: a listing that costs what is new)."""
        ...

    def exists(self, uri: str) -> bool: ...

    def size(self, uri: str) -> int: ...


def join_uri(base: str, *parts: str) -> str:
    out = base.rstrip("/")
    for part in parts:
        out += "/" + part.strip("/")
    return out


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


# ---------------------------------------------------------------------------- local


class LocalStorage:
    """Local filesystem; ``file://`` URIs and plain paths both work."""

    @staticmethod
    def _path(uri: str) -> Path:
        return Path(uri[len("file://"):] if uri.startswith("file://") else uri)

    def open_read(self, uri: str) -> BinaryIO:
        # O_NONBLOCK and a regular file only: a FIFO (or a device) at an input's path would
        # block the task forever, or stream without end; it is a clear error instead.
        try:
            fd = os.open(self._path(uri), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise StorageError(f"cannot read {uri}: {exc.strerror or exc}") from exc
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise StorageError(f"cannot read {uri}: not a regular file")
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb", buffering=READ_BUFFER_BYTES)
        except BaseException:
            os.close(fd)
            raise

    @contextmanager
    def open_write(self, uri: str) -> Iterator[BinaryIO]:
        path = self._path(uri)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(tmp, "wb", buffering=READ_BUFFER_BYTES) as fh:
                yield fh
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def write_bytes(self, uri: str, data: bytes) -> None:
        with self.open_write(uri) as fh:
            fh.write(data)

    def read_bytes(self, uri: str) -> bytes:
        with self.open_read(uri) as fh:
            return fh.read()

    def list(self, prefix_uri: str, after: str | None = None) -> list[str]:
        """Files directly or indirectly under a directory, skipping in-progress temp files."""
        root = self._path(prefix_uri)
        if not root.is_dir():
            return []
        found = sorted(str(p) for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
        if after is None:
            return found
        after_path = str(self._path(after))
        return [p for p in found if p > after_path]

    def exists(self, uri: str) -> bool:
        return self._path(uri).exists()

    def size(self, uri: str) -> int:
        try:
            return self._path(uri).stat().st_size
        except OSError as exc:
            raise StorageError(f"cannot stat {uri}: {exc.strerror or exc}") from exc


# ---------------------------------------------------------------------------- s3


def has_control_characters(text: str) -> bool:
    return any(ord(c) < 0x20 or ord(c) == 0x7F for c in text)


def split_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` as (bucket, key), the key exactly as written.

    Not ``urlparse``: it drops TAB/CR/LF anywhere and cuts the key at ``?`` or ``#``, so two
    URIs would address one object, and what a check saw would not be what was read or written.
    Control characters are refused: no check or listing can show them faithfully.
    """
    if not uri.startswith("s3://"):
        raise StorageError(f"{uri!r} is not an s3://bucket/key URI")
    if has_control_characters(uri):
        raise StorageError(f"{uri!r}: control characters are not accepted in s3:// URIs")
    bucket, _, key = uri[len("s3://"):].partition("/")
    if not bucket:
        raise StorageError(f"{uri!r} is not an s3://bucket/key URI")
    return bucket, key.lstrip("/")


def default_s3_client(config: Any = None) -> Any:
    """boto3's S3 client from the usual sources; ``config`` is a ``botocore.config.Config``
    (e.g. a larger connection pool for parallel downloads)."""
    import boto3

    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return boto3.client("s3", region_name=region, config=config)


class _S3RawReader(io.RawIOBase):
    def __init__(self, body: Any) -> None:
        self._body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._body.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._body.close()
        super().close()


class _S3Writer(io.RawIOBase):
    """Buffers one part at a time; small objects become one PUT, large ones multipart."""

    def __init__(self, client: Any, bucket: str, key: str, part_bytes: int) -> None:
        self._client, self._bucket, self._key = client, bucket, key
        self._part_bytes = part_bytes
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._buffer += data
        while len(self._buffer) >= self._part_bytes:
            self._upload_part(bytes(self._buffer[: self._part_bytes]))
            del self._buffer[: self._part_bytes]
        return len(data)

    def _upload_part(self, chunk: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = self._client.create_multipart_upload(
                Bucket=self._bucket, Key=self._key
            )["UploadId"]
        number = len(self._parts) + 1
        resp = self._client.upload_part(
            Bucket=self._bucket, Key=self._key, UploadId=self._upload_id,
            PartNumber=number, Body=chunk,
        )
        self._parts.append({"PartNumber": number, "ETag": resp["ETag"]})

    def commit(self) -> None:
        if self._upload_id is None:
            self._client.put_object(Bucket=self._bucket, Key=self._key, Body=bytes(self._buffer))
        else:
            if self._buffer:
                self._upload_part(bytes(self._buffer))
            self._client.complete_multipart_upload(
                Bucket=self._bucket, Key=self._key, UploadId=self._upload_id,
                MultipartUpload={"Parts": self._parts},
            )
        self._buffer.clear()

    def abort(self) -> None:
        if self._upload_id is not None:
            self._client.abort_multipart_upload(
                Bucket=self._bucket, Key=self._key, UploadId=self._upload_id
            )


class S3Storage:
    def __init__(self, client: Any = None, part_bytes: int = MULTIPART_PART_BYTES) -> None:
        self._client = client
        self.part_bytes = part_bytes

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = default_s3_client()
        return self._client

    def _call(self, what: str, uri: str, fn: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(**kwargs)
        except ClientError as exc:
            err = exc.response.get("Error", {})
            raise StorageError(
                f"cannot {what} {uri}: {err.get('Code', '?')} {err.get('Message', '')}".rstrip()
            ) from exc
        except BotoCoreError as exc:
            raise StorageError(f"cannot {what} {uri}: {exc}") from exc

    def open_read(self, uri: str) -> BinaryIO:
        bucket, key = split_s3_uri(uri)
        resp = self._call("read", uri, self.client.get_object, Bucket=bucket, Key=key)
        return io.BufferedReader(_S3RawReader(resp["Body"]), buffer_size=READ_BUFFER_BYTES)

    @contextmanager
    def open_write(self, uri: str) -> Iterator[BinaryIO]:
        bucket, key = split_s3_uri(uri)
        writer = _S3Writer(self.client, bucket, key, self.part_bytes)
        try:
            yield writer  # type: ignore[misc]
            self._call("write", uri, writer.commit)
        except BaseException:
            writer.abort()
            raise

    def write_bytes(self, uri: str, data: bytes) -> None:
        bucket, key = split_s3_uri(uri)
        self._call("write", uri, self.client.put_object, Bucket=bucket, Key=key, Body=data)

    def read_bytes(self, uri: str) -> bytes:
        with self.open_read(uri) as fh:
            return fh.read()

    def list(self, prefix_uri: str, after: str | None = None) -> list[str]:
        bucket, prefix = split_s3_uri(prefix_uri)
        prefix = prefix.rstrip("/") + "/"
        extra: dict[str, str] = {}
        if after is not None:
            after_bucket, after_key = split_s3_uri(after)
            if after_bucket != bucket or not after_key.startswith(prefix):
                raise StorageError(f"cannot list {prefix_uri} after {after}: not an object under it")
            extra["StartAfter"] = after_key
        paginator = self.client.get_paginator("list_objects_v2")
        out: list[str] = []
        pages = self._call("list", prefix_uri,
                           lambda: list(paginator.paginate(Bucket=bucket, Prefix=prefix, **extra)))
        for page in pages:
            out.extend(f"s3://{bucket}/{obj['Key']}" for obj in page.get("Contents", []))
        return sorted(out)

    def exists(self, uri: str) -> bool:
        from botocore.exceptions import ClientError

        bucket, key = split_s3_uri(uri)
        try:
            self.client.head_object(Bucket=bucket, Key=key)
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise StorageError(f"cannot check {uri}: {exc}") from exc

    def size(self, uri: str) -> int:
        bucket, key = split_s3_uri(uri)
        return int(self._call("stat", uri, self.client.head_object, Bucket=bucket, Key=key)["ContentLength"])


def storage_for(uri: str, s3_client: Any = None) -> Storage:
    """The storage that serves ``uri``."""
    if is_s3(uri):
        return S3Storage(s3_client)
    if "://" in uri and not uri.startswith("file://"):
        raise StorageError(f"unsupported URI scheme in {uri!r}; use a local path or s3://bucket/key")
    return LocalStorage()


def delete_object(storage: Storage, uri: str) -> None:
    """Remove one object (a local file or an S3 object); a missing one is fine (idempotent)."""
    if isinstance(storage, S3Storage):
        bucket, key = split_s3_uri(uri)
        storage.client.delete_object(Bucket=bucket, Key=key)
        return
    try:
        os.unlink(uri[len("file://"):] if uri.startswith("file://") else uri)
    except FileNotFoundError:
        pass
