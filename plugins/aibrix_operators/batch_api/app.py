"""The FastAPI app of the Batch API: thin handlers over the core modules.

Mounted by ``plugins/batch_api_plugin.py`` at ``/openai`` in the Airflow
api-server, so clients use ``base_url="http://HOST:PORT/openai/v1"``. Airflow
does not authenticate plugin routes: every route here depends on ``tenant``
(bearer key → tenant), and every lookup is scoped to that tenant's prefix or
run-id prefix, so another tenant's ids answer 404 exactly like unknown ones.
"""

# No ``from __future__ import annotations``: FastAPI must see the route signatures'
# ``Annotated`` dependencies (defined inside ``create_app``) as objects, not strings.
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from aibrix_operators.batch.admission import Admission, Estimate, Work, endpoint_label
from aibrix_operators.batch.dry_run import dry_run_answer
from aibrix_operators.batch.job import request_cancel, work_prefix
from aibrix_operators.batch.lifecycle import TERMINAL, BatchStatus
from aibrix_operators.batch_api import schemas
from aibrix_operators.batch_api.airflow_runs import BatchRuns, RunRow, run_id_for
from aibrix_operators.batch_api.auth import authenticate
from aibrix_operators.batch_api.batches import (
    API_CONF_KEY,
    check_endpoint,
    check_metadata,
    check_output_expires_after,
    check_pool,
    check_stop_rules,
    check_window,
    dag_conf,
    first_line_model,
    request_digest,
    route_for,
)
from aibrix_operators.batch_api.errors import ApiError, bad_request, error_body, not_found
from aibrix_operators.batch_api.extensions import OUTPUT_EXPIRES_AT
from aibrix_operators.batch_api.files import FileStore, StoredFile
from aibrix_operators.batch_api.ids import (
    BATCH_ID_RE,
    FILE_ID_RE,
    batch_of_output_file,
    check_batch_id,
    check_file_id,
    new_batch_id,
    output_file_id,
)
from aibrix_operators.batch_api.request_limits import RequestLimits
from aibrix_operators.batch_api.settings import ApiSettings
from aibrix_operators.batch_api.status import PARTIAL_KIND, PARTIAL_OUTPUT_KEY, batch_object
from aibrix_operators.batch_api.tenant_salt import salt_claim
from aibrix_operators.batch_api.upload import receive_upload
from aibrix_operators.lora.registry import AdapterRegistryError
from aibrix_operators.settings.lora import load_adapter_registry
from aibrix_operators.storage import Storage, StorageError, join_uri

log = logging.getLogger(__name__)
IDEMPOTENCY_KEY_RE = re.compile(r"^[\x21-\x7e]{1,255}$")
KEYRING_TTL_S = 10.0
# A multipart envelope around the file: headers and boundaries, generously.
MULTIPART_OVERHEAD = 64 * 1024


@dataclass
class ApiContext:
    """What the handlers need, built once per process by the plugin (or a test)."""

    settings: ApiSettings
    storage: Storage
    load_keyring: Callable[[], dict[str, str]]
    # HMAC key of the per-tenant vLLM cache_salt (batch_api/tenant_salt.py); None: no salt.
    cache_salt_key: bytes | None = None
    # The deployment's state root (batch/admission.py's rates and queue); None: no estimates.
    state: Storage | None = None

    def __post_init__(self) -> None:
        self.files = FileStore(self.storage, self.settings.storage_root)
        self.runs = BatchRuns(self.settings.dag_id, self.storage, self.settings.storage_root)
        self._ring: dict[str, str] = {}
        self._ring_at = -KEYRING_TTL_S
        self._lock = threading.Lock()
        # Output files this process registered or found registered: a finished batch's page
        # view costs no storage round trip for them after the first.
        self.registered: set[tuple[str, str]] = set()

    def cache_salt_claim(self, run_id: str, tenant: str) -> dict[str, str] | None:
        """What the run's conf carries instead of the tenant's salt (batch_api/tenant_salt.py)."""
        return None if self.cache_salt_key is None else salt_claim(self.cache_salt_key, run_id, tenant)

    def keyring(self) -> dict[str, str]:
        # Cached briefly: a key added or revoked takes effect within KEYRING_TTL_S.
        with self._lock:
            if time.monotonic() - self._ring_at > KEYRING_TTL_S:
                self._ring = self.load_keyring()
                self._ring_at = time.monotonic()
            return self._ring



def _adapter_bases() -> dict[str, str]:
    """The deployment's LoRA adapters (name -> base model); a broken registry counts as none here,
    and the batch's validation then fails with invalid_adapter_registry, naming the entry."""
    try:
        return load_adapter_registry().bases()
    except AdapterRegistryError:
        return {}

def create_app(context_factory: Callable[[], ApiContext]) -> FastAPI:
    app = FastAPI(title="AIBrix-on-Airflow OpenAI Batch API", version="1",
                  description="OpenAI-compatible Files and Batches API; each batch is a run of "
                  "the batch_inference DAG.")
    holder: dict[str, ApiContext] = {}
    holder_lock = threading.Lock()

    def context() -> ApiContext:
        with holder_lock:
            if "ctx" not in holder:
                holder["ctx"] = context_factory()
            return holder["ctx"]

    def tenant(authorization: Annotated[str | None, Header()] = None) -> str:
        return authenticate(authorization, context().keyring())

    Tenant = Annotated[str, Depends(tenant)]
    # Runs before FastAPI reads a body: no key, no body read; every body bounded.
    app.add_middleware(RequestLimits, keyring=lambda: context().keyring(),
                       max_upload_bytes=lambda: context().settings.max_file_bytes + MULTIPART_OVERHEAD)
    # The id patterns are published in the schema but checked by check_*_id (400 in OpenAI's
    # error shape; no route answers FastAPI's 422). Paths with control characters never get here: the
    # plugin's path guard answers them (batch_api/path_guard.py).
    FileId = Annotated[str, Path(json_schema_extra={"pattern": FILE_ID_RE.pattern})]
    BatchId = Annotated[str, Path(json_schema_extra={"pattern": BATCH_ID_RE.pattern})]
    common = schemas.error_responses(400, 401, 404)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers a bad query or body with 400 and its error body, never FastAPI's 422.
        return JSONResponse(validation_error_body(exc.errors()), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        # Log the cause for operators; the client gets no internals (paths, other tenants).
        log.exception("batch API internal error")
        return JSONResponse(error_body(500, "internal error; see the api-server log"), status_code=500)

    # ------------------------------------------------------------------ files
    @app.post("/v1/files", response_model=schemas.FileObject,
              responses=schemas.error_responses(400, 401, 413),
              openapi_extra={"requestBody": {"required": True, "content": {"multipart/form-data": {
                  "schema": {"type": "object", "required": ["file", "purpose"], "properties": {
                      "file": {"type": "string", "format": "binary"},
                      "purpose": {"type": "string", "enum": ["batch"]}}}}}}})
    async def create_file(request: Request, tenant: Tenant) -> dict[str, Any]:
        ctx = context()
        limit = ctx.settings.max_file_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit + MULTIPART_OVERHEAD:
            raise ApiError(413, f"file exceeds the maximum size of {limit} bytes", "file_too_large", "file")
        stored = await receive_upload(request.stream(), request.headers.get("content-type", ""),
                                      ctx.files, tenant, limit)
        log.info("tenant %s uploaded %s (%d bytes)", tenant, stored.id, stored.bytes)
        return stored.as_openai()

    @app.get("/v1/files", response_model=schemas.FileList, responses=common)
    def list_files(
        tenant: Tenant,
        after: Annotated[str | None, Query(max_length=100)] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
        order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
        purpose: Annotated[str | None, Query(max_length=40)] = None,
    ) -> dict[str, Any]:
        page, has_more = context().files.list(tenant, after, limit, order, purpose)
        data = [f.as_openai() for f in page]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": has_more}

    @app.get("/v1/files/{file_id}", response_model=schemas.FileObject, responses=common)
    def get_file(file_id: FileId, tenant: Tenant) -> dict[str, Any]:
        return context().files.get(tenant, check_file_id(file_id)).as_openai()

    @app.get("/v1/files/{file_id}/content", responses={
        200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
        **common}, response_class=StreamingResponse)
    def file_content(file_id: FileId, tenant: Tenant) -> StreamingResponse:
        ctx = context()
        partial_of = batch_of_output_file(check_file_id(file_id), PARTIAL_KIND)
        if partial_of is not None:
            return StreamingResponse(_partial_output(ctx, tenant, partial_of, file_id),
                                     media_type="application/octet-stream")
        try:
            chunks = ctx.files.open_content(tenant, file_id)
        except StorageError:
            raise not_found("file", file_id) from None
        return StreamingResponse(chunks, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}", response_model=schemas.FileDeleted, responses=common)
    def delete_file(file_id: FileId, tenant: Tenant) -> dict[str, Any]:
        context().files.delete(tenant, check_file_id(file_id))
        log.info("tenant %s deleted %s", tenant, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # ------------------------------------------------------------------ batches
    @app.post("/v1/batches", response_model=schemas.Batch,
              responses=schemas.error_responses(400, 401, 404, 409))
    def create_batch(
        body: schemas.CreateBatch, tenant: Tenant,
        idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
    ) -> dict[str, Any]:
        ctx = context()
        if idempotency_key is not None and not IDEMPOTENCY_KEY_RE.fullmatch(idempotency_key):
            raise bad_request("Idempotency-Key must be 1 to 255 printable ASCII characters",
                              "Idempotency-Key", "invalid_idempotency_key")
        endpoint = check_endpoint(body.endpoint)
        check_window(body.completion_window, ctx.settings.min_window_s)
        metadata = check_metadata(body.metadata)
        pool_params = check_pool(body.pool, ctx.settings.pool_limits)
        stop_rules = check_stop_rules(body.stop_rules, ctx.settings.max_batch_tokens)
        expires_after = check_output_expires_after(body.output_expires_after, ctx.settings.state_root)
        file_id = check_file_id(body.input_file_id, "input_file_id")
        try:
            stored = ctx.files.get(tenant, file_id)
        except ApiError as exc:
            if exc.status != 404:
                raise
            raise not_found("file", file_id, "input_file_id") from None  # the param the client sent
        if stored.purpose != "batch":
            raise bad_request(f"file {file_id} has purpose {stored.purpose!r}, not 'batch'",
                              "input_file_id", "invalid_input_file")
        model, route = route_for(ctx.settings, first_line_model(ctx.storage, stored.content_uri),
                                 _adapter_bases())
        digest = request_digest(body.model_dump())
        batch_id = new_batch_id(tenant, idempotency_key)
        run_id = run_id_for(tenant, batch_id)
        created_at = int(time.time())
        conf = dag_conf(ctx.settings, tenant, batch_id, file_id, stored.content_uri, endpoint,
                        body.completion_window, metadata, model, route, created_at, digest,
                        ctx.cache_salt_claim(run_id, tenant), pool_params, stop_rules, expires_after)
        row, created = ctx.runs.trigger(run_id, conf, created_at)
        if not created and row.conf.get(API_CONF_KEY, {}).get("digest") != digest:
            raise ApiError(409, "this Idempotency-Key was used for a different request",
                           "idempotency_conflict", "Idempotency-Key")
        log.info("tenant %s %s batch %s", tenant, "created" if created else "re-requested", batch_id)
        return _view(ctx, tenant, row)

    @app.post("/v1/batches/estimate", response_model=schemas.BatchEstimate,
              responses=schemas.error_responses(400, 401))
    def estimate_batch(body: schemas.EstimateRequest, tenant: Tenant) -> dict[str, Any]:
        """A dry run's estimate (docs/admission.md): when a batch of this much work would be done if
        submitted now, and what it would cost; nothing is created or sent. The client counts the
        work from the file (``aibrix-batch create --dry-run``); the rate and the queue are the
        deployment's."""
        ctx = context()
        endpoint = check_endpoint(body.endpoint)
        window_s = check_window(body.completion_window, ctx.settings.min_window_s)
        model, route = route_for(ctx.settings, body.model, _adapter_bases())
        if model is None:
            raise bad_request("model is required", "model", "model_not_found")
        work = Work(**body.work.model_dump())
        now = time.time()
        judged: Estimate | None = None
        if ctx.state is not None and ctx.settings.state_root:
            admission = Admission(ctx.state, ctx.settings.state_root, endpoint_label(route.endpoint,
                                  route.inference_conn_id), ctx.settings.admission)
            judged = admission.judge(model, work, "dry-run", int(now), int(now) + window_s, now)
        log.info("tenant %s asked for an estimate of %d requests for %s", tenant, work.requests, model)
        return dry_run_answer(model, endpoint, body.completion_window, work, judged, ctx.settings.prices)

    @app.get("/v1/batches", response_model=schemas.BatchList, responses=common)
    def list_batches(
        tenant: Tenant,
        after: Annotated[str | None, Query(max_length=100)] = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
    ) -> dict[str, Any]:
        ctx = context()
        after_run = run_id_for(tenant, check_batch_id(after, "after")) if after else None
        rows = ctx.runs.list(tenant, after_run, limit + 1)
        data = [_present(ctx, tenant, s) for s in ctx.runs.snapshots(rows[:limit])]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}

    @app.get("/v1/batches/{batch_id}", response_model=schemas.Batch, responses=common)
    def get_batch(batch_id: BatchId, tenant: Tenant) -> dict[str, Any]:
        ctx = context()
        return _view(ctx, tenant, _row(ctx, tenant, batch_id))

    @app.post("/v1/batches/{batch_id}/cancel", response_model=schemas.Batch, responses=common)
    def cancel_batch(batch_id: BatchId, tenant: Tenant) -> dict[str, Any]:
        ctx = context()
        row = _row(ctx, tenant, batch_id)
        current = _view(ctx, tenant, row)
        if current["status"] in TERMINAL or current["status"] == BatchStatus.CANCELLING:
            return current  # a finished batch stays as it is; a second cancel changes nothing
        # The marker first: it is what stops the drivers; then the same request on the run.
        request_cancel(ctx.storage, work_prefix(str(row.conf["output_uri"]), row.run_id),
                       reason=f"cancelled through the Batch API by tenant {tenant}")
        ctx.runs.record_cancel(row.run_id, int(time.time()))
        log.info("tenant %s cancelled batch %s", tenant, batch_id)
        return _view(ctx, tenant, _row(ctx, tenant, batch_id))

    _publish_no_422(app)
    return app


# pydantic's error types -> OpenAI's error codes for the same fault (the rest: invalid_value).
_VALIDATION_CODES = {
    "missing": "missing_required_parameter",
    "greater_than_equal": "integer_below_min_value", "greater_than": "integer_below_min_value",
    "less_than_equal": "integer_above_max_value", "less_than": "integer_above_max_value",
    "int_parsing": "invalid_type", "int_type": "invalid_type", "string_type": "invalid_type",
    "dict_type": "invalid_type", "model_attributes_type": "invalid_type",
    "json_invalid": "invalid_json", "string_too_long": "string_above_max_length",
    "string_pattern_mismatch": "invalid_value",
}


def validation_error_body(errors: Any) -> dict[str, Any]:
    """OpenAI's 400 body for FastAPI's first validation error: ``param`` the query parameter or
    body field (``limit``, ``metadata``), the message pydantic's words after OpenAI's
    ``Invalid 'param':`` (never the input itself, which may be large)."""
    first = errors[0] if errors else {}
    # loc[0] is query / path / header / body; an int is a position (in a list, or in the JSON text).
    param = ".".join(p for p in list(first.get("loc", ()))[1:] if isinstance(p, str)) or None
    detail = str(first.get("msg") or "malformed request")
    message = f"Invalid '{param}': {detail}" if param else f"Invalid request: {detail}"
    code = _VALIDATION_CODES.get(str(first.get("type")), "invalid_value")
    return error_body(400, message, code, param)


def _publish_no_422(app: FastAPI) -> None:
    """FastAPI documents a 422 (its own error shape) on every route with parameters; this API
    answers those faults with OpenAI's 400, so the schema says so and nothing else."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    if isinstance(operation, dict):
                        operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _row(ctx: ApiContext, tenant: str, batch_id: str) -> RunRow:
    row = ctx.runs.get(run_id_for(tenant, check_batch_id(batch_id)))
    if row is None:
        raise not_found("batch", batch_id)
    return row


def _partial_output(ctx: ApiContext, tenant: str, batch_id: str, file_id: str) -> Iterator[bytes]:
    """The answers of the batch's finished shards, while it runs (the batch object's
    ``aibrix_partial_output_file_id``). Checked before the first byte: a batch of another tenant,
    one that has ended or none of whose shards has finished is a 404 that says which."""
    try:
        row = ctx.runs.get(run_id_for(tenant, check_batch_id(batch_id)))
    except ApiError:
        row = None
    if row is None:
        raise not_found("file", file_id)
    snap = ctx.runs.snapshots([row])[0]
    if batch_object(snap, prices=ctx.settings.prices)[PARTIAL_OUTPUT_KEY] != file_id:
        raise ApiError(404, f"batch {batch_id} has no partial output now: it has ended (read its "
                            "output_file_id) or none of its shards has finished yet",
                       "partial_output_unavailable", "file_id")
    return ctx.runs.partial_output(snap, row.run_id)


def _view(ctx: ApiContext, tenant: str, row: RunRow) -> dict[str, Any]:
    return _present(ctx, tenant, ctx.runs.snapshots([row])[0])


def _present(ctx: ApiContext, tenant: str, snap: Any) -> dict[str, Any]:
    obj = batch_object(snap, prices=ctx.settings.prices)
    # An extra field beside OpenAI's (the SDK keeps extras: batch.monitor_url): the run's page
    # in the Airflow UI, for the people who follow a batch there.
    obj["monitor_url"] = ctx.settings.monitor_url(run_id_for(tenant, snap.batch_id))
    if obj["status"] in TERMINAL:
        expires_at = (snap.batch_json or {}).get(OUTPUT_EXPIRES_AT)
        _register_outputs(ctx, tenant, snap.batch_id, str(snap.conf.get("output_uri", "")), obj,
                          expires_at if isinstance(expires_at, int) else None)
    return obj


def _register_outputs(ctx: ApiContext, tenant: str, batch_id: str, output: str, obj: dict[str, Any],
                      expires_at: int | None = None) -> None:
    """Make the batch's output/error files visible as files (once; idempotent)."""
    for kind, name in (("output", "output.jsonl"), ("errors", "errors.jsonl")):
        file_id = output_file_id(batch_id, kind)
        if file_id not in (obj["output_file_id"], obj["error_file_id"]):
            continue
        if len(ctx.registered) > 100_000:
            ctx.registered.clear()
        if (tenant, file_id) in ctx.registered or ctx.files.exists(tenant, file_id):
            ctx.registered.add((tenant, file_id))
            continue
        uri = join_uri(output, name)
        try:
            size = ctx.storage.size(uri)
        except StorageError:
            continue
        ctx.files.save_meta(tenant, StoredFile(
            id=file_id, bytes=size, created_at=int(obj.get("completed_at") or obj.get("cancelled_at")
                                                   or obj.get("expired_at") or time.time()),
            filename=f"{batch_id}_{name}", purpose="batch_output", content_uri=uri, expires_at=expires_at))
        ctx.registered.add((tenant, file_id))
