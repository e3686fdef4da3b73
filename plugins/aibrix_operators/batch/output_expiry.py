"""Outputs that expire: OpenAI's ``output_expires_after`` and the sweep that deletes them.

A batch that asks for it (``{"anchor": "created_at", "seconds": N}``, OpenAI's shape and bounds:
one hour to 30 days) has its output and error files expire ``N`` seconds after they were created
(merge's end). Merge writes the instant into ``batch.json`` (``aibrix_output_expires_at``) and an
*expiry record* into the deployment's expiry index (``expiring/`` under ``[aibrix_batch] state_root``):
the files to delete and the connection that may. The cleanup task (``dags/output_cleanup.py``) lists the index
and deletes what is due, never a file whose record says a later instant; ``batch.json`` is kept
(the batch's own record), and the Batch API's files answer 404 once their ``expires_at`` is past.

Core: no Airflow. The index is one flat prefix of small JSON objects named
``<expires_at, 10 digits>-<batch id>.json``, so a listing in name order is a listing by due time.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aibrix_operators.storage import Storage, delete_object, join_uri

log = logging.getLogger(__name__)

ANCHOR = "created_at"  # OpenAI's only anchor: the file's creation
MIN_SECONDS = 3600  # OpenAI's bounds: one hour ...
MAX_SECONDS = 30 * 24 * 3600  # ... to 30 days
# The files of a batch that expire (beside batch.json, which stays as the batch's record).
EXPIRING_FILES = ("output.jsonl", "errors.jsonl")


def parse_expires_after(value: Any) -> int | None:
    """``output_expires_after`` → seconds; None when absent. ValueError saying what to send."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) != {"anchor", "seconds"}:
        raise ValueError('output_expires_after must be an object {"anchor": "created_at", "seconds": N}')
    if value["anchor"] != ANCHOR:
        raise ValueError(f"output_expires_after.anchor must be {ANCHOR!r} (the file's creation)")
    seconds = value["seconds"]
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not MIN_SECONDS <= seconds <= MAX_SECONDS:
        raise ValueError(f"output_expires_after.seconds must be a whole number from {MIN_SECONDS} (1 hour) "
                         f"to {MAX_SECONDS} (30 days); got {seconds!r}")
    return seconds


@dataclass(frozen=True)
class ExpiryRecord:
    """A batch's expiring files, as merge leaves them in the index."""

    batch_id: str
    expires_at: int
    uris: tuple[str, ...]
    aws_conn_id: str | None = None

    def name(self) -> str:
        return f"{self.expires_at:010d}-{self.batch_id}.json"

    def to_bytes(self) -> bytes:
        return json.dumps({"batch_id": self.batch_id, "expires_at": self.expires_at, "uris": list(self.uris),
                           "aws_conn_id": self.aws_conn_id}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> ExpiryRecord:
        data = json.loads(raw)
        expires_at = data["expires_at"]
        if isinstance(expires_at, bool) or not isinstance(expires_at, int):
            raise ValueError(f"expires_at {expires_at!r} is not a Unix time")
        uris = data["uris"]
        if not isinstance(uris, list) or not all(isinstance(u, str) for u in uris):
            raise ValueError("uris must be a list of strings")
        return cls(str(data["batch_id"]), expires_at, tuple(uris), data.get("aws_conn_id") or None)


def expiry_index(state_root: str) -> str:
    """The index of expiry records under the deployment's state root."""
    return join_uri(state_root, "expiring")


def expiring_uris(output_uri: str) -> tuple[str, ...]:
    return tuple(join_uri(output_uri, name) for name in EXPIRING_FILES)


def write_record(index: Storage, index_root: str, record: ExpiryRecord) -> str:
    uri = join_uri(index_root, record.name())
    index.write_bytes(uri, record.to_bytes())
    return uri


@dataclass
class SweepResult:
    deleted: list[str]  # files deleted
    records_done: int  # records whose files are all gone (the record deleted too)
    not_due: int  # records left for later
    refused: list[str]  # records the sweep would not act on, and why


def sweep(index: Storage, index_root: str, now: float, storage_for: Callable[[str, str | None], Storage],
          allowed: Callable[[str, str | None], str | None]) -> SweepResult:
    """Delete every file whose record is due (``expires_at <= now``), then its record.

    ``storage_for(uri, aws_conn_id)`` opens a file's storage; ``allowed(uri, aws_conn_id)`` is the
    deployment's check that the sweep may touch it (None: yes; else why not): a record is the
    pipeline's own, and the sweep still deletes only ``output.jsonl``/``errors.jsonl`` that the
    deployment's allow-list covers. A file already gone counts as deleted; a store that fails
    leaves the record for the next sweep."""
    result = SweepResult([], 0, 0, [])
    for uri in index.list(index_root):
        name = uri.rsplit("/", 1)[-1]
        due_text = name.split("-", 1)[0]
        if not name.endswith(".json") or not due_text.isdigit():
            continue
        if int(due_text) > now:  # named by due time: nothing later in the listing is due either
            result.not_due += 1
            continue
        try:
            record = ExpiryRecord.from_bytes(index.read_bytes(uri))
        except (ValueError, KeyError, TypeError) as exc:
            result.refused.append(f"{name}: unreadable ({exc})")
            continue
        if record.expires_at > now:  # the content decides, not the name
            result.not_due += 1
            continue
        problems = [why for f in record.uris if (why := _refusal(f, record.aws_conn_id, allowed))]
        if problems:
            result.refused.append(f"{name}: {'; '.join(problems)}")
            continue
        try:
            for file_uri in record.uris:
                store = storage_for(file_uri, record.aws_conn_id)
                if store.exists(file_uri):
                    delete_object(store, file_uri)
                    result.deleted.append(file_uri)
            delete_object(index, uri)
            result.records_done += 1
        except Exception as exc:  # noqa: BLE001 - a store hiccup: the next sweep tries again
            log.warning("could not delete the expired files of %s (%s); will try again", record.batch_id, exc)
    return result


Allowed = Callable[[str, str | None], str | None]


def _refusal(uri: str, aws_conn_id: str | None, allowed: Allowed) -> str | None:
    if uri.rsplit("/", 1)[-1] not in EXPIRING_FILES:
        return f"{uri} is not a batch's output or error file"
    return allowed(uri, aws_conn_id)
