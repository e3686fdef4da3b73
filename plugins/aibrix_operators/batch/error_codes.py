"""Every error code a batch's user can see, in one place (core: no Airflow).

Codes end up in three places, one enum each:

* ``RequestError``: ``error.code`` of a line in ``errors.jsonl`` (one request, written by the driver).
* ``ValidationCode``: ``errors.data[].code`` of a ``batch.json`` that failed in validation (with
  the line number when a line is at fault), also the Batch API's ``errors``.
* ``BatchFailure``: ``errors.data[].code`` of a ``batch.json`` that failed for the batch as a whole
  (a refused trigger, a step after validation, a driver pod), also the Batch API's ``errors``.

The members are ``str`` (``StrEnum``): JSON, XCom and log lines get the plain value. Each says when it
is used and whether trying again can help. ``docs/failure-semantics.md#error-codes`` has the same list
as a table and ``tests/unit/test_error_codes.py`` keeps the two, and the code, in step: no module
spells a code as a string literal. Not here, on purpose: a server's own error codes, which the driver
copies into error lines as they are (``http_code`` when the body has none), and the Batch API's HTTP
request errors (``invalid_api_key``, ``invalid_file_id``, ...: ``batch_api/``), which belong to the
API's requests, not to a batch.
"""

from __future__ import annotations

from enum import StrEnum


class RequestError(StrEnum):
    """``error.code`` of an ``errors.jsonl`` line: a request that ended without a 2xx answer."""

    # The completion window ended before the request was answered; retry: only in a new batch.
    BATCH_EXPIRED = "batch_expired"
    # The batch was cancelled before the request was answered; retry: resubmit it if still wanted.
    BATCH_CANCELLED = "batch_cancelled"
    # One of the batch's stop rules tripped (max_error_rate, max_total_tokens) before the request was
    # answered; the batch's own error says which rule and the figures; retry: resubmit it if still wanted.
    BATCH_STOPPED = "batch_stopped"
    # Every charged attempt timed out while the endpoint answered others; retry: may help.
    TIMEOUT = "timeout"
    # Every charged attempt lost its connection while the endpoint answered others; retry: may help.
    CONNECTION_ERROR = "connection_error"
    # The request could not be sent at all (neither the network nor the server: e.g. its body); retry: no.
    REQUEST_FAILED = "request_failed"
    # A 2xx whose body is not a JSON object (each charged attempt), or cannot be stored; retry: may help.
    INVALID_RESPONSE_BODY = "invalid_response_body"
    # The endpoint answered 3xx; redirects are not followed; retry: no, point the endpoint at the server.
    ENDPOINT_REDIRECTED = "endpoint_redirected"
    # The server answered 404 for the request's model, which it served before or was told to load
    # (a restart that lost a LoRA adapter): paused as an outage while a replay fails the same way,
    # an error line only when nothing showed the endpoint had it; retry: yes, once it serves it.
    MODEL_NOT_LOADED = "model_not_loaded"
    # Shared mode withdrew the attempt for online traffic; it is sent again and never charged, so
    # it names only an expired or cancelled request's last attempt; retry: automatic.
    PREEMPTED_FOR_ONLINE = "preempted_for_online"


class ValidationCode(StrEnum):
    """A batch that failed validation, before any inference; retry: no, unless said otherwise."""

    # The batch's endpoint is not one of the supported ones; retry: no, fix the endpoint.
    INVALID_ENDPOINT = "invalid_endpoint"
    # The file is over max_file_bytes; retry: no, split the file or raise the limit.
    FILE_TOO_LARGE = "file_too_large"
    # A line is over max_line_bytes; retry: no, shorten it or raise the limit.
    LINE_TOO_LARGE = "line_too_large"
    # The file starts with a UTF-8 byte order mark; retry: no, save it without one.
    BOM_NOT_ALLOWED = "bom_not_allowed"
    # A line ends with \r\n; retry: no, use \n.
    CRLF_LINE_ENDING = "crlf_line_ending"
    # Blank line(s) between requests (one error per run of them); retry: no, remove them.
    BLANK_LINE = "blank_line"
    # The file has more than max_requests requests; retry: no, split it or raise the limit.
    TOO_MANY_REQUESTS = "too_many_requests"
    # The file holds no request; retry: no.
    EMPTY_FILE = "empty_file"
    # A line is not valid UTF-8; retry: no, re-encode the file.
    INVALID_ENCODING = "invalid_encoding"
    # The last line is incomplete JSON without a final newline (a cut-off upload); retry: no, upload again.
    TRUNCATED_LINE = "truncated_line"
    # A line is not JSON, or not a JSON object; retry: no, fix the line.
    INVALID_JSON_LINE = "invalid_json_line"
    # A line has an unpaired \ud800-\udfff escape; retry: no, fix the text's encoding.
    LONE_SURROGATE = "lone_surrogate"
    # A line has NaN, Infinity or a number too large for a float; retry: no.
    INVALID_NUMBER = "invalid_number"
    # custom_id, method, url or body is missing (param names it); retry: no.
    MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
    # custom_id is not a non-empty string, or body not an object (param names it); retry: no.
    INVALID_PARAMETER_TYPE = "invalid_parameter_type"
    # A line's method is not POST; retry: no.
    INVALID_METHOD = "invalid_method"
    # A line's url is not a supported endpoint; retry: no.
    INVALID_URL = "invalid_url"
    # A line's url differs from the batch's endpoint; retry: no, one endpoint per batch.
    MISMATCHED_ENDPOINT = "mismatched_endpoint"
    # A line's body.model is missing or not a non-empty string; retry: no.
    MISSING_MODEL = "missing_model"
    # A line's body.model differs from the first line's, or from the model submitted; retry: no.
    MISMATCHED_MODEL = "mismatched_model"
    # A line's body.model is neither the batch's base model nor one of the deployment's LoRA
    # adapters of that base (docs/lora.md); retry: no, fix body.model or ask for the adapter.
    UNKNOWN_MODEL = "unknown_model"
    # A field the line's endpoint requires in body is missing (body.input, body.query...); retry: no.
    MISSING_BODY_FIELD = "missing_body_field"
    # A body field has a type the line's endpoint does not take (param names it); retry: no.
    INVALID_BODY_FIELD = "invalid_body_field"
    # The body asks for stream or background, which a batch cannot return; retry: no, remove it.
    NOT_SUPPORTED_IN_BATCH = "not_supported_in_batch"
    # A custom_id already appears on an earlier line; retry: no, ids are unique in a batch.
    DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
    # completion_window is not a positive duration like 24h; retry: no.
    INVALID_COMPLETION_WINDOW = "invalid_completion_window"
    # The input file does not exist; retry: no, fix input_uri.
    INPUT_NOT_FOUND = "input_not_found"
    # These credentials may not read the input; retry: no, fix the connection or the grant.
    INPUT_ACCESS_DENIED = "input_access_denied"
    # Reading the input failed otherwise (e.g. a read broke off); retry: a new run may help.
    INPUT_UNREADABLE = "input_unreadable"
    # A stop rule (max_error_rate, error_rate_min_sample, max_total_tokens) is out of range or over
    # the deployment's limit (the message says which and how to fix it); retry: no.
    INVALID_STOP_RULES = "invalid_stop_rules"
    # output_expires_after is not {"anchor": "created_at", "seconds": 3600..2592000}, or the deployment
    # keeps no state ([aibrix_batch] state_root); retry: no, fix it or leave it out.
    INVALID_OUTPUT_EXPIRES_AFTER = "invalid_output_expires_after"
    # At the endpoint's measured rate, behind the earlier-deadline work queued there, the batch would
    # end after its window, and the deployment refuses such batches ([aibrix_batch] admission =
    # refuse); the message names the shortest window that would be met; retry: with that window.
    WINDOW_INFEASIBLE = "window_infeasible"


class BatchFailure(StrEnum):
    """A batch that failed as a whole: its ``batch.json`` says ``failed`` with one of these."""

    # The allow-list refuses the trigger (a URI, connection, endpoint, namespace...); retry: no.
    REFUSED_BY_POLICY = "refused_by_policy"
    # The input's or output's storage could not be opened (unknown connection or scheme); retry: no.
    INVALID_STORAGE = "invalid_storage"
    # Input and output are on different kinds of storage; retry: no.
    INVALID_OUTPUT_URI = "invalid_output_uri"
    # The run failed and no step said why (see the task logs); retry: clearing failed tasks resumes.
    BATCH_RUN_FAILED = "batch_run_failed"
    # The endpoint does not serve the batch's model; retry: no, fix the model or the endpoint.
    MODEL_NOT_SERVED = "model_not_served"
    # A shard's LoRA adapter could not be fetched, verified or loaded (the message names it: a
    # digest mismatch, a missing object, a server without runtime LoRA loading; docs/lora.md).
    # The batch's other shards run; retry: no, until the deployment fixes the adapter or server.
    ADAPTER_LOAD_FAILED = "adapter_load_failed"
    # The deployment's adapter registry ([aibrix_batch] lora_adapters) is unreadable or invalid.
    # retry: no, the deployment must fix the file.
    INVALID_ADAPTER_REGISTRY = "invalid_adapter_registry"
    # Shared capacity mode cannot apply: capacity_mode contradicts the deployment, a shared setting
    # is out of range, or the server does not schedule by priority; retry: no (docs/shared-capacity.md).
    CAPACITY_MODE_REFUSED = "capacity_mode_refused"
    # A job-pool value has the wrong shape (over a limit: refused_by_policy); retry: no, fix the pool.
    INVALID_JOB_POOL = "invalid_job_pool"
    # The endpoint was unreachable at the preflight check or past outage_budget_s; retry: yes, resumes.
    ENDPOINT_UNAVAILABLE = "endpoint_unavailable"
    # Reading a shard or writing checkpoints or outputs kept failing; retry: yes, resumes.
    STORAGE_ERROR = "storage_error"
    # Merge found an id missing or unknown (every id once, exactly); retry: no, a person must look.
    EXACTLY_ONCE_VIOLATION = "exactly_once_violation"
    # A shard changed after it was planned; retry: no, re-split (clear split).
    INPUT_CHANGED = "input_changed"
    # split raised something without a code of its own; retry: may help (see its log).
    SPLIT_FAILED = "split_failed"
    # dispatch raised something without a code of its own; retry: may help (see its log).
    DISPATCH_FAILED = "dispatch_failed"
    # merge raised something without a code of its own; retry: may help (see its log).
    MERGE_FAILED = "merge_failed"
    # The driver CLI rejected its arguments (exit 2; a bug in the pod spec); retry: no.
    DRIVER_BAD_ARGUMENTS = "driver_bad_arguments"
    # The driver hit an internal error (exit 70); retry: yes, resumes.
    DRIVER_INTERNAL_ERROR = "driver_internal_error"
    # The driver pod vanished before it finished (deleted, node lost); retry: yes, resumes.
    DRIVER_POD_LOST = "driver_pod_lost"
    # The driver pod was evicted; retry: yes, resumes.
    DRIVER_POD_EVICTED = "driver_pod_evicted"
    # The driver pod ran past activeDeadlineSeconds; retry: yes, it records the expiry.
    DRIVER_POD_DEADLINE_EXCEEDED = "driver_pod_deadline_exceeded"
    # The driver image cannot be pulled; retry: no, fix driver_image or the registry credentials.
    DRIVER_IMAGE_PULL_FAILED = "driver_image_pull_failed"
    # The driver container cannot start (a Secret or key missing); retry: no.
    DRIVER_POD_CONFIG_ERROR = "driver_pod_config_error"
    # The driver pod was not scheduled in time; retry: yes.
    DRIVER_POD_UNSCHEDULABLE = "driver_pod_unschedulable"
    # The driver container was OOM-killed; retry: yes, resumes (raise driver_memory_limit).
    DRIVER_POD_OOM_KILLED = "driver_pod_oom_killed"
    # The driver finished but its outcome line was not in its log; retry: yes, re-reads the shard.
    DRIVER_OUTCOME_MISSING = "driver_outcome_missing"
    # The driver pod failed otherwise (a signal, an unknown exit, no end); retry: yes, resumes.
    DRIVER_POD_FAILED = "driver_pod_failed"
    # The Kubernetes API answered 401/403 (RBAC); retry: no, the identity needs the pod rights.
    KUBERNETES_FORBIDDEN = "kubernetes_forbidden"
    # The namespace's ResourceQuota had no room for the driver pod (a 403 "exceeded quota");
    # retry: yes, the pod is created again once running pods free the quota.
    KUBERNETES_QUOTA_EXCEEDED = "kubernetes_quota_exceeded"
    # Admission refused the driver pod as specified (PodSecurity, a LimitRange, a missing
    # ServiceAccount); retry: no, fix the driver-pod settings or the namespace's policy.
    KUBERNETES_POD_REFUSED = "kubernetes_pod_refused"
    # The batch's max_error_rate tripped: that share of its requests failed with their own errors
    # (never an outage) over at least error_rate_min_sample answers; it stopped sending and its
    # answers so far are in the output; retry: no, fix the requests (see errors.jsonl).
    MAX_ERROR_RATE_EXCEEDED = "max_error_rate_exceeded"
    # The batch's tokens (input + output) reached its max_total_tokens budget; it stopped sending and
    # its answers so far are in the output; retry: resubmit the rest with a larger budget.
    MAX_TOTAL_TOKENS_EXCEEDED = "max_total_tokens_exceeded"
    # Another Kubernetes API failure (after the provider's own retries); retry: yes.
    KUBERNETES_API_ERROR = "kubernetes_api_error"


# The lines of requests nobody answered because the batch ended first: not the requests' own errors
# (a stop rule's error rate does not count them; aibrix_unanswered does).
UNANSWERED = frozenset({RequestError.BATCH_EXPIRED, RequestError.BATCH_CANCELLED, RequestError.BATCH_STOPPED})

ALL_CODES: tuple[type[StrEnum], ...] = (RequestError, ValidationCode, BatchFailure)


class CodedFailure(Exception):
    """A failure that says, itself, the code a batch's user sees for it and whether trying the
    step again can help: the failure table is these attributes of its subclasses, one place per
    failure type. The operators' step errors (``operators/step_errors.py``) take the code from
    the first coded failure along an exception's cause chain, and dispatch lets Airflow retry
    only a retryable one (``operators/dispatch.py``). A subclass sets both as class attributes
    (or, like ``DriverPodFailure``, per instance)."""

    error_code: str  # a BatchFailure value
    retryable: bool


def http_code(status: int) -> str:
    """The error line's code for an HTTP error whose body names no code or type of its own."""
    return f"http_{status}"
