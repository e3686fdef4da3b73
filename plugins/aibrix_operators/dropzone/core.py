"""Drop-zone bookkeeping over an S3 client (boto3's interface); imports no Airflow.

A batch is started once per **(name, content)**: ``name`` is the object's key under the inbox
prefix, content is its SHA-256 (computed by streaming the object; an ETag is not a content
digest: multipart uploads of the same bytes get different ETags depending on the part size,
and SSE-KMS ETags are not MD5s at all). Everything the drop zone keeps lives in S3 beside the
results, under ``<outbox>/_dropzone/``:

* ``seen/<version id>``: one small marker per inbox object *version* (name, ETag, size) already
  handled, so a poll costs two LISTs and nothing is hashed twice;
* ``claims/<batch key>.json``: one per (name, content) a batch was started for: its run id, the
  digest, where its input snapshot and results are. This is the record that makes a re-upload of
  the same content, or a second look at the same object, start nothing;
* ``inputs/<sha256>.jsonl``: the snapshot the batch reads (a server-side copy pinned to the ETag
  that was hashed), so overwriting the inbox file while its batch waits cannot change what it
  processes.

Inbox names with a path segment starting with ``.`` or ``_`` (temporary files, ``_SUCCESS``)
and folder markers are ignored; that also keeps ``_dropzone/`` apart from every result folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from aibrix_operators.batch.records import output_key_problem, work_prefix
from aibrix_operators.storage import has_control_characters, split_s3_uri

log = logging.getLogger(__name__)

STATE_DIR = "_dropzone"
RUN_ID_PREFIX = "dropzone__"
HASH_CHUNK_BYTES = 1024 * 1024
# S3's single CopyObject limit. A bigger drop is read in place (no snapshot); with the batch's
# default max_file_bytes (200 MB) it fails validation as file_too_large like any other trigger.
COPY_LIMIT_BYTES = 5 * 1024**3
# DAG params the drop zone derives itself; a deployment's dag_conf may not set them.
DERIVED_PARAMS = frozenset({"input_uri", "output_uri", "aws_conn_id", "metadata"})


class DropZoneConfigError(ValueError):
    """The deployment's drop-zone settings are missing or inconsistent."""


def _prefix(uri: str, what: str) -> str:
    if not uri.startswith("s3://"):
        raise DropZoneConfigError(f"{what} {uri!r} must be an s3://bucket/prefix/ URI")
    bucket, key = split_s3_uri(uri)
    key = key.strip("/")
    return f"s3://{bucket}/{key}/" if key else f"s3://{bucket}/"


@dataclass(frozen=True)
class DropZone:
    """Where files land and where their results go (both ``s3://bucket/prefix/``)."""

    inbox: str
    outbox: str

    @classmethod
    def parse(cls, inbox: str, outbox: str) -> DropZone:
        inbox, outbox = _prefix(inbox, "inbox"), _prefix(outbox, "outbox")
        # Results under the inbox would come back as new drops; an inbox under the outbox could
        # shadow a result folder. Keep them apart.
        if inbox.startswith(outbox) or outbox.startswith(inbox):
            raise DropZoneConfigError(f"inbox {inbox} and outbox {outbox} must not contain each other")
        return cls(inbox, outbox)

    @property
    def state(self) -> str:
        return f"{self.outbox}{STATE_DIR}/"

    def source_uri(self, name: str) -> str:
        return self.inbox + name

    def output_uri(self, name: str) -> str:
        return self.outbox + name

    def input_snapshot_uri(self, sha256: str) -> str:
        return f"{self.state}inputs/{sha256}.jsonl"

    def seen_uri(self, obj: InboxObject) -> str:
        return f"{self.state}seen/{obj.version_id}"

    def claim_uri(self, name: str, sha256: str) -> str:
        return f"{self.state}claims/{batch_key(name, sha256)}.json"


@dataclass(frozen=True)
class InboxObject:
    """One version of an inbox object, as listed."""

    name: str
    etag: str
    size: int

    @property
    def version_id(self) -> str:
        return _digest(self.name, self.etag, str(self.size))[:40]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Claim:
    """A (name, content) a batch is to be started for."""

    name: str
    etag: str
    size: int
    sha256: str
    source_uri: str
    input_uri: str
    output_uri: str
    run_id: str
    claimed_at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ClaimOutcome:
    """What claiming one listed object found: ``new`` (start a batch), ``duplicate`` (this name
    with this content already has one: ``run_id``), ``changed`` (replaced or deleted since it
    was listed; its next version is a new listing entry), or ``refused`` (no batch can run for
    it as it is named: ``reason`` says why and what to do)."""

    status: str
    obj: InboxObject
    claim: Claim | None = None
    run_id: str | None = None
    sha256: str | None = None
    reason: str | None = None


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def batch_key(name: str, sha256: str) -> str:
    return _digest(name, sha256)[:32]


def run_id_for(name: str, sha256: str) -> str:
    """The batch_inference run id of (name, content): deterministic, so Airflow itself refuses a
    second run for it, and readable (the name's safe characters, then the key)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")[:80] or "file"
    return f"{RUN_ID_PREFIX}{slug}__{batch_key(name, sha256)[:20]}"


def is_candidate(name: str) -> bool:
    """A drop is a file name; hidden/temporary names and folder markers are not."""
    if not name or name.endswith("/"):
        return False
    return not any(part.startswith((".", "_")) or part == "" for part in name.split("/"))


def unaddressable(name: str) -> str | None:
    """Why storage cannot address this drop exactly (so it is never claimed), or ``None``."""
    if has_control_characters(name):
        return "its name has control characters (TAB, CR, LF, ...), which s3:// URIs do not carry"
    return None


def key_length_problem(zone: DropZone, name: str) -> str | None:
    """Why the batch of drop ``name`` could not write its keys (S3's 1,024-byte limit), or None.

    Its results go under ``outbox/<name>/`` and its work under ``_work/<run id>/`` there; the run
    id's length depends on the name alone (its content key is fixed-length), so any digest gives
    the length of the keys it will write (``batch.records.LONGEST_WORK_KEY_SUFFIX``)."""
    problem = output_key_problem(work_prefix(zone.output_uri(name), run_id_for(name, "0" * 64)))
    if problem is None:
        return None
    return (f"its name ({len(name.encode())} bytes) is too long: {problem}; upload it again under "
            "a name that much shorter")


_refused: set[str] = set()  # names already logged by this process: each is reported once


def parse_listing(zone: DropZone, contents: Iterable[dict[str, Any]]) -> list[InboxObject]:
    """Inbox objects from ``list_objects_v2`` entries (sync or async client alike).

    A drop whose name storage cannot address, or whose batch's keys would be over S3's limit,
    is left out with a warning (once per process), so it is never claimed and never takes a
    place of ``max_files_per_run`` from the others.
    """
    _, prefix = split_s3_uri(zone.inbox)
    out = []
    for entry in contents:
        name = entry["Key"][len(prefix):]
        if not (entry["Key"].startswith(prefix) and is_candidate(name)):
            continue
        if reason := unaddressable(name):
            if name not in _refused:
                _refused.add(name)
                log.warning("drop zone: ignoring %r in %s: %s; rename it", name, zone.inbox, reason)
            continue
        if reason := key_length_problem(zone, name):
            if name not in _refused:
                _refused.add(name)
                log.warning("drop zone: ignoring %.120r in %s: %s", name, zone.inbox, reason)
            continue
        out.append(InboxObject(name, str(entry.get("ETag", "")).strip('"'), int(entry.get("Size", 0))))
    return out


def seen_ids(zone: DropZone, contents: Iterable[dict[str, Any]]) -> set[str]:
    _, prefix = split_s3_uri(zone.state + "seen/")
    return {entry["Key"][len(prefix):] for entry in contents if entry["Key"].startswith(prefix)}


def new_objects(objects: Iterable[InboxObject], seen: set[str]) -> list[InboxObject]:
    """Objects whose version has no seen marker, oldest listing order kept (S3 lists by key)."""
    return [obj for obj in objects if obj.version_id not in seen]


def _list(client: Any, uri: str) -> list[dict[str, Any]]:
    bucket, prefix = split_s3_uri(uri)
    out: list[dict[str, Any]] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out.extend(page.get("Contents", []))
    return out


def find_new(client: Any, zone: DropZone) -> list[InboxObject]:
    """Inbox objects not handled yet (the synchronous twin of the trigger's poll)."""
    return new_objects(parse_listing(zone, _list(client, zone.inbox)),
                       seen_ids(zone, _list(client, zone.state + "seen/")))


def _error_code(exc: Exception) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


# The object changed (other ETag) or vanished between listing and reading.
_CHANGED = {"PreconditionFailed", "412", "NoSuchKey", "404", "NotFound"}


def _exists(client: Any, uri: str) -> bool:
    from botocore.exceptions import ClientError

    bucket, key = split_s3_uri(uri)
    try:
        client.head_object(Bucket=bucket, Key=key)
        return True
    except ClientError as exc:
        if _error_code(exc) in ("404", "NoSuchKey", "NotFound"):
            return False
        raise


def _read_json(client: Any, uri: str) -> dict[str, Any]:
    bucket, key = split_s3_uri(uri)
    return json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())


def _hash_version(client: Any, zone: DropZone, obj: InboxObject) -> str:
    """SHA-256 of exactly the listed version (``IfMatch`` its ETag), streamed."""
    bucket, key = split_s3_uri(zone.source_uri(obj.name))
    body = client.get_object(Bucket=bucket, Key=key, IfMatch=f'"{obj.etag}"')["Body"]
    digest = hashlib.sha256()
    try:
        while chunk := body.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    finally:
        body.close()
    return digest.hexdigest()


def _snapshot(client: Any, zone: DropZone, obj: InboxObject, sha256: str) -> str:
    """Server-side copy of the hashed version to its content address (once per content)."""
    uri = zone.input_snapshot_uri(sha256)
    if not _exists(client, uri):
        src_bucket, src_key = split_s3_uri(zone.source_uri(obj.name))
        bucket, key = split_s3_uri(uri)
        client.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": src_bucket, "Key": src_key},
                           CopySourceIfMatch=f'"{obj.etag}"')
    return uri


def mark_seen(client: Any, zone: DropZone, obj: InboxObject, note: dict[str, Any]) -> None:
    bucket, key = split_s3_uri(zone.seen_uri(obj))
    client.put_object(Bucket=bucket, Key=key, Body=json.dumps({**obj.as_dict(), **note}).encode(),
                      ContentType="application/json")


def claim(client: Any, zone: DropZone, obj: InboxObject) -> ClaimOutcome:
    """Hash ``obj``; a (name, content) with a claim record is a ``duplicate`` (and its version is
    marked seen); otherwise snapshot it and return a ``new`` claim, recorded only by ``record``
    once its run exists. Claiming the same thing twice before ``record`` is harmless: both give
    the same run id, and Airflow creates that run once. A drop whose batch would write keys
    over S3's limit is ``refused`` before anything is read or copied."""
    from botocore.exceptions import ClientError

    if reason := key_length_problem(zone, obj.name):
        log.error("drop zone: not starting a batch for %.120r: %s", obj.name, reason)
        return ClaimOutcome("refused", obj, reason=reason)
    try:
        sha256 = _hash_version(client, zone, obj)
        claim_uri = zone.claim_uri(obj.name, sha256)
        if _exists(client, claim_uri):
            run_id = str(_read_json(client, claim_uri).get("run_id"))
            mark_seen(client, zone, obj, {"sha256": sha256, "duplicate_of": run_id})
            return ClaimOutcome("duplicate", obj, run_id=run_id, sha256=sha256)
        input_uri = (_snapshot(client, zone, obj, sha256) if obj.size <= COPY_LIMIT_BYTES
                     else zone.source_uri(obj.name))
    except ClientError as exc:
        if _error_code(exc) in _CHANGED:
            return ClaimOutcome("changed", obj)
        raise
    new = Claim(name=obj.name, etag=obj.etag, size=obj.size, sha256=sha256,
                source_uri=zone.source_uri(obj.name), input_uri=input_uri,
                output_uri=zone.output_uri(obj.name), run_id=run_id_for(obj.name, sha256))
    return ClaimOutcome("new", obj, claim=new, run_id=new.run_id, sha256=sha256)


def record(client: Any, zone: DropZone, new: Claim) -> None:
    """Record a started claim, then mark its version seen. The claim is written only if absent
    (``If-None-Match: *``), so the first record of a (name, content) is the one kept."""
    from botocore.exceptions import ClientError

    bucket, key = split_s3_uri(zone.claim_uri(new.name, new.sha256))
    try:
        client.put_object(Bucket=bucket, Key=key, Body=json.dumps(new.as_dict()).encode(),
                          ContentType="application/json", IfNoneMatch="*")
    except ClientError as exc:
        if _error_code(exc) not in ("PreconditionFailed", "412"):
            raise
    obj = InboxObject(new.name, new.etag, new.size)
    mark_seen(client, zone, obj, {"sha256": new.sha256, "run_id": new.run_id})


def batch_conf(new: Claim, dag_conf: dict[str, Any], aws_conn_id: str | None) -> dict[str, Any]:
    """The batch_inference params of a claim: the deployment's ``dag_conf`` plus what the drop
    zone derives (input snapshot, output folder, connection, provenance in ``metadata``)."""
    return {
        **dag_conf,
        "input_uri": new.input_uri,
        "output_uri": new.output_uri,
        "aws_conn_id": aws_conn_id or None,
        "metadata": {"dropzone_source": new.source_uri[:512], "dropzone_sha256": new.sha256},
    }
