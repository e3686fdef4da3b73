"""The store side of a model fetch: the S3 client, the manifest read and pinned, and store
errors said in one line with the exit status of their kind."""

from __future__ import annotations

import hashlib
from typing import Any

from aibrix_operators.serving.model_fetch.dest import (
    EXIT_MISMATCH,
    EXIT_MISSING,
    EXIT_STORE,
    EXIT_USAGE,
    FetchError,
)
from aibrix_operators.serving.model_manifest import (
    MAX_MANIFEST_BYTES,
    ManifestError,
    ManifestFile,
    parse_manifest,
)
from aibrix_operators.storage import StorageError, default_s3_client, split_s3_uri


def s3_client(workers: int) -> Any:
    from botocore.config import Config

    # One pooled connection per worker, or the workers queue for connections.
    return default_s3_client(
        Config(max_pool_connections=workers + 2, retries={"mode": "standard", "max_attempts": 5})
    )


def _store_error(exc: Exception, uri: str, path: str) -> FetchError:
    from botocore.exceptions import ClientError

    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", "?"))
        if code in ("NoSuchKey", "404", "NotFound"):
            return FetchError(
                f"{path}: {uri} is missing from the store ({code}); upload it or fix the manifest",
                EXIT_MISSING,
            )
        if code == "InvalidRange":
            return FetchError(
                f"{path}: {uri} is smaller than the manifest says; re-upload it or fix the manifest",
                EXIT_MISMATCH,
            )
        return FetchError(f"{path}: cannot read {uri}: {code} {err.get('Message', '')}".rstrip(), EXIT_STORE)
    return FetchError(f"{path}: cannot read {uri}: {type(exc).__name__}: {exc}", EXIT_STORE)


def read_manifest(location: str, client: Any, pin: str | None) -> list[ManifestFile]:
    """The manifest at a local path or ``s3://`` URI, checked against its pinned sha256."""
    try:
        if location.startswith("s3://"):
            bucket, key = split_s3_uri(location)
            try:
                body = client.get_object(Bucket=bucket, Key=key)["Body"]
                data = body.read(MAX_MANIFEST_BYTES + 1)
            except Exception as exc:  # noqa: BLE001 - botocore's errors, named in one line
                raise _store_error(exc, location, "manifest") from exc
        else:
            with open(location, "rb") as fh:
                data = fh.read(MAX_MANIFEST_BYTES + 1)
    except (StorageError, OSError) as exc:
        raise FetchError(f"manifest {location}: {exc}", EXIT_USAGE) from exc
    if pin is not None and hashlib.sha256(data).hexdigest() != pin.lower():
        raise FetchError(
            f"manifest {location}: sha256 {hashlib.sha256(data).hexdigest()} is not the pinned "
            f"{pin}; publish the manifest the deployment pins, or update the pin",
            EXIT_USAGE,
        )
    try:
        return parse_manifest(data, f"manifest {location}")
    except ManifestError as exc:
        raise FetchError(str(exc), EXIT_USAGE) from exc
