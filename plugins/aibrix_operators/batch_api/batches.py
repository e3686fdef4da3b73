"""``POST /v1/batches``: the request's rules, and the DAG run conf the API derives from it.

The client names a file id, an endpoint, a completion window and metadata;
everything the DAG needs beyond that (input and output locations, inference
endpoint or connection, storage connection) comes from the deployment's
settings, never from the request.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from typing import Any

from aibrix_operators.batch.error_codes import BatchFailure, ValidationCode
from aibrix_operators.batch.job_pool import JobPool, JobPoolError, JobPoolLimits, PoolLimitExceeded
from aibrix_operators.batch.output_expiry import ANCHOR, parse_expires_after
from aibrix_operators.batch.records import (
    DEFAULT_MIN_COMPLETION_WINDOW,
    SUPPORTED_ENDPOINTS,
    check_min_window,
    parse_completion_window,
)
from aibrix_operators.batch.stop_rules import StopRules
from aibrix_operators.batch_api.errors import bad_request
from aibrix_operators.batch_api.files import batch_output_uri
from aibrix_operators.batch_api.settings import ApiSettings, ModelRoute
from aibrix_operators.batch_api.tenant_salt import CLAIM_KEY
from aibrix_operators.storage import Storage

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_WINDOW_S = 7 * 24 * 3600
# Unicode categories a metadata key may not hold: control (Cc: NUL, TAB, LF, ...), format (Cf:
# zero-width and bidi marks, which make two keys look alike) and unpaired surrogates (Cs).
_REFUSED_KEY_CATEGORIES = frozenset({"Cc", "Cf", "Cs"})
DEFAULT_MIN_WINDOW_S = parse_completion_window(DEFAULT_MIN_COMPLETION_WINDOW)
FIRST_LINE_LIMIT = 4 * 1024 * 1024
# The conf key that carries what the API needs back (file id, creation time); not a DAG param.
API_CONF_KEY = "openai_batch"


def check_metadata(metadata: Any) -> dict[str, str]:
    """OpenAI's rules for ``metadata``: at most 16 pairs, keys of 1 to 64 characters without
    control or invisible (format) characters, string values of at most 512; else 400. What is
    accepted is kept exactly as given (the API adds nothing to it: ``aibrix_status`` is a field
    of its own on the batch object)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise bad_request("metadata must be an object of string pairs", "metadata", "invalid_metadata")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise bad_request(f"metadata may have at most {MAX_METADATA_PAIRS} pairs, not {len(metadata)}",
                          "metadata", "invalid_metadata")
    for key, value in metadata.items():
        shown = repr(key[:MAX_METADATA_KEY]) if isinstance(key, str) else type(key).__name__
        if not isinstance(key, str) or not key:
            raise bad_request("metadata keys must be non-empty strings", "metadata", "invalid_metadata")
        if len(key) > MAX_METADATA_KEY:
            raise bad_request(f"metadata keys may have at most {MAX_METADATA_KEY} characters "
                              f"({shown}... has {len(key)})", "metadata", "invalid_metadata")
        if any(unicodedata.category(c) in _REFUSED_KEY_CATEGORIES for c in key):
            raise bad_request(f"metadata key {shown} has a control or invisible character",
                              "metadata", "invalid_metadata")
        if not isinstance(value, str):
            raise bad_request(f"metadata values must be strings (the value of {shown} is "
                              f"{type(value).__name__})", "metadata", "invalid_metadata")
        if len(value) > MAX_METADATA_VALUE:
            raise bad_request(f"metadata values may have at most {MAX_METADATA_VALUE} characters "
                              f"(the value of {shown} has {len(value)})", "metadata", "invalid_metadata")
        if any(unicodedata.category(c) == "Cs" for c in value):
            raise bad_request(f"the metadata value of {shown} has an unpaired surrogate",
                              "metadata", "invalid_metadata")
    return dict(metadata)


def check_pool(pool: Any, limits: JobPoolLimits) -> dict[str, Any]:
    """The ``pool`` extension field (docs/job-pool.md) as the DAG params it sets; 400 for a value
    of the wrong shape, or over the deployment's limit (named, never clipped)."""
    try:
        parsed = JobPool.from_mapping(pool, "pool")
        parsed.check(limits)
    except PoolLimitExceeded as exc:
        raise bad_request(str(exc), "pool", "pool_limit_exceeded") from None
    except JobPoolError as exc:
        raise bad_request(str(exc), "pool", BatchFailure.INVALID_JOB_POOL) from None
    return parsed.as_params()


def check_window(window: str, min_window_s: int = DEFAULT_MIN_WINDOW_S) -> int:
    """``24h`` and other whole durations (``90m``, ``3600s``) from the deployment's minimum
    (``[aibrix_batch] min_completion_window``, 1h by default) up to a week; else 400."""
    try:
        seconds = check_min_window(window, min_window_s)
    except ValueError as exc:
        raise bad_request(str(exc), "completion_window", "invalid_completion_window") from None
    if seconds > MAX_WINDOW_S:
        raise bad_request("completion_window may be at most 168h", "completion_window",
                          "invalid_completion_window")
    return seconds


def check_stop_rules(rules: Any, max_batch_tokens: int | None) -> dict[str, Any] | None:
    """A create request's ``stop_rules`` (batch/stop_rules.py) under the deployment's token limit,
    as the DAG's validate step will read them; 400 ``invalid_stop_rules`` otherwise."""
    try:
        checked = StopRules.from_dict(rules).within(max_batch_tokens)
    except ValueError as exc:
        raise bad_request(str(exc), "stop_rules", ValidationCode.INVALID_STOP_RULES) from None
    return checked.as_dict() if checked.active else None


def check_output_expires_after(value: Any, state_root: str | None) -> dict[str, Any] | None:
    """A create request's ``output_expires_after`` (OpenAI's shape and bounds), or None; 400
    ``invalid_output_expires_after`` for another, or when the deployment deletes no outputs
    (no ``[aibrix_batch] state_root``): a promise to delete must not be accepted and not kept."""
    try:
        seconds = parse_expires_after(value)
    except ValueError as exc:
        raise bad_request(str(exc), "output_expires_after",
                          ValidationCode.INVALID_OUTPUT_EXPIRES_AFTER) from None
    if seconds is None:
        return None
    if not state_root:
        raise bad_request("this deployment does not delete outputs ([aibrix_batch] state_root is not set); "
                          "leave output_expires_after out", "output_expires_after",
                          ValidationCode.INVALID_OUTPUT_EXPIRES_AFTER)
    return {"anchor": ANCHOR, "seconds": seconds}


def check_endpoint(endpoint: str) -> str:
    if endpoint not in SUPPORTED_ENDPOINTS:
        raise bad_request(f"endpoint must be one of {list(SUPPORTED_ENDPOINTS)}", "endpoint",
                          "invalid_endpoint")
    return endpoint


def first_line_model(storage: Storage, uri: str) -> str | None:
    """``body.model`` of the file's first line, or None if it cannot be read (validation in
    the DAG then reports the file's errors with line numbers)."""
    with storage.open_read(uri) as stream:
        line = stream.readline(FIRST_LINE_LIMIT)
    try:
        model = json.loads(line)["body"]["model"]
    except (ValueError, KeyError, TypeError):
        return None
    return model if isinstance(model, str) else None


def route_for(
    settings: ApiSettings, model: str | None, adapter_bases: dict[str, str] | None = None
) -> tuple[str | None, ModelRoute]:
    """The route of ``model``; 400 naming the models on offer if it is not one of them. A LoRA
    adapter of the deployment's registry (``adapter_bases``: name -> base) goes where its base
    goes, and the batch's model is the base (docs/lora.md: one base model per batch)."""
    base = (adapter_bases or {}).get(model) if model is not None else None
    if base is not None and model not in settings.models and base in settings.models:
        model = base
    offered = sorted(settings.models)
    if not offered:
        raise bad_request("this deployment serves no models (api_models is empty)", "model",
                          "model_not_found")
    if model is None:
        # Unreadable first line: the DAG's validation fails the batch with line numbers.
        return None, settings.models[offered[0]]
    if model not in settings.models:
        raise bad_request(f"model {model[:100]!r} is not served here; models on offer: "
                          f"{', '.join(offered)}", "model", "model_not_found")
    return model, settings.models[model]


def request_digest(body: dict[str, Any]) -> str:
    """Identifies a create request, so an Idempotency-Key reused for a different one is a 409."""
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32]


def dag_conf(
    settings: ApiSettings, tenant: str, batch_id: str, input_file_id: str, input_uri: str,
    endpoint: str, window: str, metadata: dict[str, str], model: str | None, route: ModelRoute,
    created_at: int, digest: str, salt_claim: dict[str, str] | None = None,
    pool_params: dict[str, Any] | None = None, stop_rules: dict[str, Any] | None = None,
    output_expires_after: dict[str, Any] | None = None,
) -> dict[str, Any]:
    conf: dict[str, Any] = {
        **settings.dag_conf,
        # The batch's pool, checked against the deployment's limits (check_pool).
        **(pool_params or {}),
        "input_uri": input_uri,
        "output_uri": batch_output_uri(settings.storage_root, tenant, batch_id),
        "batch_endpoint": endpoint,
        "model": model,
        "completion_window": window,
        "metadata": metadata,
        "stop_rules": stop_rules or {},
        "output_expires_after": output_expires_after,
        "aws_conn_id": settings.aws_conn_id,
        **route.dag_params(),
        # No salt in the conf (anyone who may read the run would see it): a claim the dispatch
        # task verifies against its run id, and derives the tenant's salt from (tenant_salt.py).
        "cache_salt": None,
        API_CONF_KEY: {"input_file_id": input_file_id, "created_at": created_at, "digest": digest,
                       **({CLAIM_KEY: salt_claim} if salt_claim else {})},
    }
    return conf
