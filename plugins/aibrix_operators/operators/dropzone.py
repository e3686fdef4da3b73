"""The drop zone's tasks: wait for new inbox objects (deferred), claim them, record the started ones.

``dags/s3_dropzone.py`` wires them around a mapped ``TriggerDagRunOperator``:
``wait`` → ``claim`` → ``start_batch`` (one per new claim) → ``record``.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from aibrix_operators.dropzone.core import (
    Claim,
    DropZoneConfigError,
    InboxObject,
    batch_conf,
    claim,
    record,
)
from aibrix_operators.settings.dropzone import DropZoneSettings, load_settings
from aibrix_operators.triggers.dropzone import DropZoneTrigger

log = logging.getLogger(__name__)
CLAIMS_KEY = "claims"


def _s3_client(aws_conn_id: str | None) -> Any:
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    return S3Hook(aws_conn_id=aws_conn_id).get_conn()


class DropZoneSensor(BaseOperator):
    """Defers to ``DropZoneTrigger`` (no worker slot while waiting); returns the unhandled object
    versions it found. Nothing new within ``wait_timeout_s``: skipped, and the next run of the
    continuous DAG waits again. Not configured: waits an hour (deferred), then fails with what to
    set, so an unpaused, unconfigured drop zone fails once an hour, not in a tight loop."""

    NOT_CONFIGURED_WAIT = timedelta(hours=1)

    ui_color = "#e8f4ea"

    def execute(self, context: Context) -> list[dict[str, Any]]:
        try:
            settings = load_settings()
        except DropZoneConfigError as exc:
            from airflow.providers.standard.triggers.temporal import TimeDeltaTrigger

            log.error("%s", exc)
            self.defer(trigger=TimeDeltaTrigger(self.NOT_CONFIGURED_WAIT), method_name="not_configured",
                       kwargs={"message": str(exc)})
        log.info("watching %s (results under %s), polling every %gs for up to %gs",
                 settings.zone.inbox, settings.zone.outbox, settings.poll_interval_s,
                 settings.wait_timeout_s)
        self.defer(trigger=DropZoneTrigger(
            settings.zone.inbox, settings.zone.outbox, settings.aws_conn_id, settings.poll_interval_s,
            settings.wait_timeout_s, settings.max_files_per_run,
        ), method_name="execute_complete")

    def not_configured(self, context: Context, event: Any = None, message: str = "") -> None:
        raise AirflowFailException(message)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> list[dict[str, Any]]:
        if event["status"] == "found":
            log.info("new in the inbox: %s", ", ".join(o["name"] for o in event["objects"]))
            return event["objects"]
        if event.get("error"):
            raise AirflowFailException(f"the inbox could not be listed: {event['error']}")
        raise AirflowSkipException("nothing new in the inbox")


class ClaimDropsOperator(BaseOperator):
    """Claims each found object (``core.claim``): hashes it, skips (name, content) pairs that
    already have a batch, snapshots the rest. Returns one ``TriggerDagRunOperator`` kwargs dict per
    new claim (for ``expand_kwargs``) and pushes the claims as XCom ``claims`` for ``record``."""

    template_fields = ("objects",)

    def __init__(self, *, objects: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.objects = objects

    def execute(self, context: Context) -> list[dict[str, Any]]:
        settings: DropZoneSettings = load_settings()
        client = _s3_client(settings.aws_conn_id)
        claims: list[Claim] = []
        for item in self.objects or []:
            outcome = claim(client, settings.zone, InboxObject(**item))
            if outcome.claim is not None:
                claims.append(outcome.claim)
                log.info("%s: new (sha256 %s) → run %s, results in %s", item["name"], outcome.sha256,
                         outcome.run_id, outcome.claim.output_uri)
            elif outcome.status == "duplicate":
                log.info("%s: same content as run %s; nothing started", item["name"], outcome.run_id)
            else:
                log.info("%s: replaced or deleted since listed; its next version is seen next time",
                         item["name"])
        context["ti"].xcom_push(key=CLAIMS_KEY, value=[c.as_dict() for c in claims])
        return [{"trigger_run_id": c.run_id, "conf": batch_conf(c, settings.dag_conf, settings.aws_conn_id)}
                for c in claims]


class RecordClaimsOperator(BaseOperator):
    """Once every ``start_batch`` ended without failing (created, or skipped because the run
    already existed): writes the record and seen marker of each of ``claim_task_id``'s claims.
    If any start failed this does not run; those objects are claimed again next time, and the
    deterministic run id keeps the ones that did start from starting twice."""

    def __init__(self, *, claim_task_id: str = "claim", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.claim_task_id = claim_task_id

    def execute(self, context: Context) -> int:
        claims = context["ti"].xcom_pull(task_ids=self.claim_task_id, key=CLAIMS_KEY) or []
        if not claims:
            raise AirflowSkipException("no new claims")
        settings = load_settings()
        client = _s3_client(settings.aws_conn_id)
        for item in claims:
            record(client, settings.zone, Claim(**item))
        log.info("recorded %d claim(s)", len(claims))
        return len(claims)
