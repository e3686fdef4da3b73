"""Failed batches: a specific error code for what went wrong, and a batch.json that says so.

Every failure leaves ``batch.json`` (``status: failed``) where the output goes,
if that place is writable; if it is not, ``FailureRecord.describe()`` says so
in words for the task log. Messages are one line, with no traceback: they are
what the user reads.
"""

from __future__ import annotations

import errno
import json
import time
from dataclasses import dataclass
from typing import Any

from aibrix_operators.batch.error_codes import ValidationCode
from aibrix_operators.batch.lifecycle import BatchStatus
from aibrix_operators.batch.merging import BATCH_FILE
from aibrix_operators.batch.records import DEFAULT_COMPLETION_WINDOW, BatchObject
from aibrix_operators.storage import Storage, StorageError, join_uri

# S3 error codes that mean "these credentials may not do this".
_S3_DENIED = {
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
    "InvalidToken", "AllBucketsAccessDisabled", "403", "Forbidden",
}
_S3_MISSING = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}
MAX_MESSAGE_CHARS = 1000


def storage_error_code(exc: BaseException) -> ValidationCode:
    """``input_not_found`` / ``input_access_denied`` / ``input_unreadable`` for a failure to read the input.

    The cause is read from the exception chain (``StorageError`` wraps the OS or
    botocore error), so the code does not depend on message wording.
    """
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, FileNotFoundError | NotADirectoryError) or (
            isinstance(cur, OSError) and cur.errno in (errno.ENOENT, errno.ENOTDIR)
        ):
            return ValidationCode.INPUT_NOT_FOUND
        if isinstance(cur, PermissionError):
            return ValidationCode.INPUT_ACCESS_DENIED
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            if code in _S3_DENIED:
                return ValidationCode.INPUT_ACCESS_DENIED
            if code in _S3_MISSING:
                return ValidationCode.INPUT_NOT_FOUND
        if type(cur).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
            return ValidationCode.INPUT_ACCESS_DENIED
        cur = cur.__cause__ or cur.__context__
    return ValidationCode.INPUT_UNREADABLE


def one_line(message: str) -> str:
    """A user-facing message: one line, bounded."""
    text = " ".join(str(message).split())
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "..."


def error_list(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"object": "list", "data": [{"code": code, "message": one_line(message), "param": param,
                                        "line": None}], "total": 1}


@dataclass(frozen=True)
class FailureRecord:
    """Where a failed batch's ``batch.json`` went, or why it could not be written."""

    uri: str | None
    written: bool
    reason: str | None = None

    def describe(self) -> str:
        if self.written:
            return f"the failed batch is recorded in {self.uri}"
        if self.uri is None:
            return f"no batch.json was written: {self.reason}"
        return f"batch.json could not be written to {self.uri}: {self.reason}"


def failed_batch(
    *,
    batch_id: str,
    input_uri: str,
    errors: dict[str, Any],
    endpoint: str = "",
    completion_window: str = DEFAULT_COMPLETION_WINDOW,
    created_at: int | None = None,
    expires_at: int | None = None,
    total_requests: int = 0,
    metadata: dict[str, str] | None = None,
) -> BatchObject:
    now = int(time.time())
    batch = BatchObject(
        id=batch_id, endpoint=endpoint, input_file_id=input_uri, completion_window=completion_window,
        status=BatchStatus.FAILED, errors=errors, created_at=created_at or now, failed_at=now,
        expires_at=expires_at, metadata=metadata or None,
    )
    batch.request_counts["total"] = total_requests
    return batch


def publish_failure(storage: Storage, output_uri: str, batch: BatchObject) -> FailureRecord:
    """Write ``batch.json``; a storage failure is reported, not raised (the batch already failed)."""
    uri = join_uri(output_uri, BATCH_FILE)
    try:
        storage.write_bytes(uri, json.dumps(batch.as_dict(), indent=2).encode() + b"\n")
    except (StorageError, OSError) as exc:
        return FailureRecord(uri, False, one_line(str(exc)))
    return FailureRecord(uri, True)
