"""Ids, tenant names and file names: the only client text that ever reaches a storage path.

Ids are generated here and checked against a strict pattern before use, so
``..``, absolute paths, separators or odd Unicode in an id can never form a
path: they are refused with 400 before any lookup. Ids begin with the creation
time in hex, so sorting ids sorts by age (listing needs no index).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
import unicodedata

from aibrix_operators.batch_api.errors import bad_request

TENANT_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,46}[a-z0-9])?$")
FILE_ID_RE = re.compile(r"^file-[0-9a-f]{12}[0-9a-f]{20}(?:-(?:output|errors|partial))?$")
BATCH_ID_RE = re.compile(r"^batch_[0-9a-f]{32}$")
# These patterns are published in the OpenAPI schema (JSON Schema's "$" is the end of the text);
# in Python "$" also matches before a trailing newline, so every check here is a fullmatch.
MAX_FILENAME_CHARS = 255


def _time_prefix() -> str:
    return f"{time.time_ns() // 1_000_000:012x}"


def new_file_id() -> str:
    return f"file-{_time_prefix()}{secrets.token_hex(10)}"


def new_batch_id(tenant: str, idempotency_key: str | None = None) -> str:
    """A fresh id, or with an ``Idempotency-Key`` one derived from (tenant, key): the DAG run
    id is unique in Airflow's database, so a retried create finds the first run instead of
    starting a second one, even when two retries race."""
    if idempotency_key is None:
        return f"batch_{_time_prefix()}{secrets.token_hex(10)}"
    digest = hashlib.sha256(f"{tenant}\0{idempotency_key}".encode()).hexdigest()
    return f"batch_{digest[:32]}"


def output_file_id(batch_id: str, kind: str) -> str:
    """The id under which a batch's ``output.jsonl``/``errors.jsonl`` is registered as a file."""
    return f"file-{batch_id.removeprefix('batch_')}-{kind}"


def batch_of_output_file(file_id: str, kind: str) -> str | None:
    """The batch whose ``kind`` file ``file_id`` is (``output_file_id``'s inverse), or None."""
    if not file_id.startswith("file-") or not file_id.endswith(f"-{kind}"):
        return None
    return "batch_" + file_id.removeprefix("file-").removesuffix(f"-{kind}")


def check_tenant(name: str) -> str:
    if not TENANT_RE.fullmatch(name):
        raise ValueError(f"tenant name {name!r} must match {TENANT_RE.pattern}")
    return name


def check_file_id(file_id: str, param: str = "file_id") -> str:
    if not FILE_ID_RE.fullmatch(file_id):
        raise bad_request(f"invalid file id {_shown(file_id)}", param, "invalid_file_id")
    return file_id


def check_batch_id(batch_id: str, param: str = "batch_id") -> str:
    if not BATCH_ID_RE.fullmatch(batch_id):
        raise bad_request(f"invalid batch id {_shown(batch_id)}", param, "invalid_batch_id")
    return batch_id


def check_filename(name: str) -> str:
    """A file name is kept as metadata only (never a path), but still must be a plain name:
    no separators, no ``..``, no control/format characters (bidi overrides, zero-width),
    NFC-normalized, at most 255 characters."""
    if not name or len(name) > MAX_FILENAME_CHARS:
        raise bad_request("filename must be 1 to 255 characters", "file", "invalid_filename")
    if unicodedata.normalize("NFC", name) != name:
        raise bad_request("filename must be NFC-normalized Unicode", "file", "invalid_filename")
    if "/" in name or "\\" in name or name in (".", "..") or ".." in name:
        raise bad_request("filename must not contain path separators or '..'", "file", "invalid_filename")
    if any(unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp") for ch in name):
        raise bad_request("filename contains control or invisible characters", "file", "invalid_filename")
    return name


def _shown(value: str) -> str:
    # Echo a bounded, escaped form: a hostile id must not inject into logs or clients.
    return ascii(value[:80])
