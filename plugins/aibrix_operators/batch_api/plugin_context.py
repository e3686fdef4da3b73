"""Builds the API's context from the Airflow deployment (config section, Variable, storage)."""

from __future__ import annotations

import gc
import json
import logging
import os
from pathlib import Path
from typing import Any

from aibrix_operators import config_sections
from aibrix_operators.batch_api.app import ApiContext
from aibrix_operators.batch_api.auth import VARIABLE, parse_keyring
from aibrix_operators.batch_api.settings import load_settings
from aibrix_operators.batch_api.tenant_salt import VARIABLE as SALT_VARIABLE
from aibrix_operators.batch_api.tenant_salt import load_cache_salt_key
from aibrix_operators.settings.locations import api_storage_root
from aibrix_operators.storage import is_s3, storage_for

log = logging.getLogger(__name__)
SECTION = config_sections.BATCH


def build_context() -> ApiContext:
    from airflow.configuration import conf

    # The storage root is the deployment's: no folder of the package (settings/locations.py).
    settings = load_settings(lambda key: conf.get(SECTION, key, fallback=None), Path(api_storage_root()),
                             ui_base_url=conf.get("api", "base_url", fallback=None))
    client: Any = None
    if is_s3(settings.storage_root) and settings.aws_conn_id:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        client = S3Hook(aws_conn_id=settings.aws_conn_id).get_conn()
    if not is_s3(settings.storage_root):
        os.makedirs(settings.storage_root, exist_ok=True)
    salt_key = load_cache_salt_key(conf.get(SECTION, "api_cache_salt", fallback=None), _salt_variable,
                                   _store_salt_variable)
    context = ApiContext(settings, storage_for(settings.storage_root, client), load_keyring, salt_key,
                         state=_state_storage(settings.state_root, settings.state_aws_conn_id))
    if conf.getboolean(SECTION, "api_gc_tuning", fallback=True):
        tune_gc()
    return context


def _state_storage(root: str | None, aws_conn_id: str | None) -> Any:
    """The deployment's state root (rates, the admission queue: batch/admission.py), or None."""
    if not root:
        return None
    client: Any = None
    if is_s3(root) and aws_conn_id:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        client = S3Hook(aws_conn_id=aws_conn_id).get_conn()
    return storage_for(root, client)


# Young-generation threshold (CPython's default is 700 allocations).
GC_GEN0_THRESHOLD = 20_000


def tune_gc() -> None:
    """Keep the cyclic GC from stalling the api-server; once per process, on the first Batch
    API request. ``api_gc_tuning = False`` in ``[aibrix_batch]`` leaves the GC as it is.

    Measured by bench/batch_api.py (the stalls hit Airflow's own routes just the same):
    the api-server holds ~700k long-lived objects (Airflow's models, FastAPI apps,
    providers), and a full collection walked all of them: 0.3 s idle, 0.7 s under load, a
    stall of every request in flight. ``gc.freeze`` moves them out of the collector's
    reach (they live as long as the process anyway). What the Execution API and requests
    build later still made a 0.2 s full collection about every second under load: with
    the default threshold of 700, objects of requests still in flight are promoted and
    count towards the next full collection. At 20,000 they die young instead (one full
    collection in a whole bench run). Together: list p99 0.7 s → < 0.1 s.
    """
    gc.collect()
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, GC_GEN0_THRESHOLD), gen1, gen2)
    log.info("Batch API: %d startup objects frozen out of the cyclic GC; thresholds %s",
             gc.get_freeze_count(), gc.get_threshold())


def _salt_variable() -> str | None:
    from airflow.models.variable import Variable

    return Variable.get(SALT_VARIABLE, default_var=None)


def _store_salt_variable(value: str) -> None:
    from airflow.models.variable import Variable

    Variable.set(SALT_VARIABLE, value, description="HMAC key of the Batch API tenants' vLLM cache_salt")


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
