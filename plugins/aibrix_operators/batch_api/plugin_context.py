"""Builds the API's context from the Airflow deployment (config section, Variable, storage)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from aibrix_operators.batch_api.app import ApiContext
from aibrix_operators.batch_api.auth import VARIABLE, parse_keyring
from aibrix_operators.batch_api.settings import load_settings
from aibrix_operators.localenv import WORK_DIR
from aibrix_operators.storage import is_s3, storage_for

log = logging.getLogger(__name__)
SECTION = "aibrix_batch"


def build_context() -> ApiContext:
    from airflow.configuration import conf

    settings = load_settings(lambda key: conf.get(SECTION, key, fallback=None), WORK_DIR / "batch-api")
    client: Any = None
    if is_s3(settings.storage_root) and settings.aws_conn_id:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        client = S3Hook(aws_conn_id=settings.aws_conn_id).get_conn()
    if not is_s3(settings.storage_root):
        os.makedirs(settings.storage_root, exist_ok=True)
    return ApiContext(settings, storage_for(settings.storage_root, client), load_keyring)


def load_keyring() -> dict[str, str]:
    """The Variable's digests; an unreadable or malformed Variable means no key is valid."""
    try:
        from airflow.models.variable import Variable

        text = Variable.get(VARIABLE, default_var=None)
        if isinstance(text, dict):
            text = json.dumps(text)
        return parse_keyring(text)
    except Exception as exc:  # noqa: BLE001 - fail closed, and say why in the api-server log
        log.error("Batch API keys unavailable (Variable %s): %s", VARIABLE, type(exc).__name__)
        return {}
