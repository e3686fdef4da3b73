"""``DropZoneTrigger``: wait, in the triggerer, until the inbox holds an object not handled yet."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from aibrix_operators.dropzone.core import DropZone, new_objects, parse_listing, seen_ids
from aibrix_operators.storage import split_s3_uri

log = logging.getLogger(__name__)


async def _list(client: Any, uri: str) -> list[dict[str, Any]]:
    bucket, prefix = split_s3_uri(uri)
    out: list[dict[str, Any]] = []
    async for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out.extend(page.get("Contents", []))
    return out


class DropZoneTrigger(BaseTrigger):
    """Every ``poll_interval_s``: LIST the inbox and the seen markers (two paginated LISTs, no
    object is read); fire ``{"status": "found", "objects": [...]}`` with up to ``max_files``
    unhandled object versions. A failing poll (S3 down, credentials) is logged and retried at the
    next one; when ``timeout_s`` passes the event is ``{"status": "timeout", "error": <the last
    poll's error or null>}``, so a drop zone that cannot reach S3 fails visibly once per wait
    instead of never firing."""

    def __init__(self, inbox: str, outbox: str, aws_conn_id: str | None, poll_interval_s: float,
                 timeout_s: float, max_files: int, started_at: float | None = None) -> None:
        super().__init__()
        self.inbox, self.outbox, self.aws_conn_id = inbox, outbox, aws_conn_id
        self.poll_interval_s, self.timeout_s, self.max_files = poll_interval_s, timeout_s, max_files
        self.started_at = started_at if started_at is not None else time.time()

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "inbox": self.inbox, "outbox": self.outbox, "aws_conn_id": self.aws_conn_id,
            "poll_interval_s": self.poll_interval_s, "timeout_s": self.timeout_s,
            "max_files": self.max_files, "started_at": self.started_at})

    async def poll(self, zone: DropZone) -> list[dict[str, Any]]:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        async with await S3Hook(aws_conn_id=self.aws_conn_id).get_async_conn() as client:
            objects = parse_listing(zone, await _list(client, zone.inbox))
            if not objects:
                return []
            seen = seen_ids(zone, await _list(client, zone.state + "seen/"))
        return [obj.as_dict() for obj in new_objects(objects, seen)[: self.max_files]]

    async def run(self) -> AsyncIterator[TriggerEvent]:
        zone = DropZone.parse(self.inbox, self.outbox)
        last_error: str | None = None
        while True:
            try:
                found = await self.poll(zone)
                last_error = None
                if found:
                    yield TriggerEvent({"status": "found", "objects": found})
                    return
            except Exception as exc:  # noqa: BLE001 - any poll failure waits for the next poll
                last_error = f"{type(exc).__name__}: {exc}"
                log.warning("drop zone %s: poll failed, retrying in %gs: %s",
                            zone.inbox, self.poll_interval_s, last_error)
            if time.time() - self.started_at >= self.timeout_s:
                yield TriggerEvent({"status": "timeout", "error": last_error})
                return
            await asyncio.sleep(self.poll_interval_s)
