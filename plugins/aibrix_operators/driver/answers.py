"""What one HTTP answer (or a failed attempt) means for its request: the driver's classification.

``classify`` turns an answer into the request's result line (a success, or an error that is the
request's own: a 4xx other than 408/429, a redirect) or a ``Failure`` worth another attempt (a
retryable status, a garbled 2xx, a model the server lost); ``transport_failure`` does the same
for an attempt that got no answer. What happens to a ``Failure`` (retries, the outage breaker,
charging attempts) is ``runner._Sender``'s (ARCHITECTURE.md §5). Error lines name no address of
the deployment: a server's error text and exception messages are scrubbed.
"""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any

from aibrix_operators.batch.error_codes import RequestError, http_code
from aibrix_operators.batch.jsonfast import JSONDecodeError, loads
from aibrix_operators.batch.records import Usage, error_record, success_record
from aibrix_operators.driver.retry import (
    exception_code,
    is_backpressure_status,
    is_retryable_exception,
    is_retryable_status,
    parse_retry_after,
)
from aibrix_operators.trust.redact import scrub_addresses, scrub_json

log = logging.getLogger(__name__)


@dataclass
class Failure:
    """An attempt that may succeed if tried again; becomes an error line only if it is the request's."""

    code: str
    message: str
    status: int | None = None
    request_id: str | None = None
    body: Any = None
    retry_after: float | None = None
    backpressure: bool = False  # 408/429: the server is fine and asks us to wait

    def as_record(self, custom_id: str, attempts: int) -> dict[str, Any]:
        suffix = f" (after {attempts} attempt{'s' * (attempts > 1)})"
        return error_record(custom_id, self.code, self.message + suffix, self.status, self.request_id,
                            self.body)


def classify(
    custom_id: str, status: int, raw: bytes, headers: Any, usage: Usage
) -> dict[str, Any] | Failure:
    """One HTTP answer as a result line, or as a failure worth another attempt. A success's
    token usage is added to ``usage`` (the shard's)."""
    request_id = headers.get("x-request-id")
    if 200 <= status < 300:
        try:
            body = loads(raw)
        except JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            # A proxy's page or a half-written answer: the infrastructure's, worth a retry.
            return Failure(
                RequestError.INVALID_RESPONSE_BODY,
                f"server answered {status} with a body that is not a JSON object: {raw[:200]!r}",
                status, request_id, raw[:2000].decode("utf-8", "replace"),
            )
        usage.add_response_body(body)
        return success_record(custom_id, status, request_id or _body_id(body), body)
    body = _parse_error_body(raw)
    if 300 <= status < 400:
        # Where it points is for the task log only: the error line reaches the submitter
        # (a Batch API tenant too), who must not learn the deployment's addresses.
        _log_redirect(status, str(headers.get("location", ""))[:200])
        return error_record(
            custom_id, RequestError.ENDPOINT_REDIRECTED,
            f"the endpoint answered HTTP {status}, a redirect; redirects are not followed (requests "
            "go only to the allow-listed endpoint): point endpoint at the server that answers "
            "(the task log names the redirect's target)", status, request_id,
            scrub_json(body),
        )  # fmt: skip
    # A server's error text may name addresses too (a proxy's error page, an upstream it
    # could not reach): the line goes to the submitter without them.
    body = scrub_json(body)
    code, message = _error_of(status, body)
    if status == 404 and _names_an_unknown_model(body):
        # Validation lets through only the batch's model and the deployment's adapters of it,
        # so a server that does not know the model has lost it (restarted without the LoRA
        # adapters loaded at run time, or replaced): the endpoint's fault. Retried; when the
        # canary replay gets the same answer the breaker pauses the shard, and past the outage
        # budget the task fails and its retry loads the adapter again (operators/dispatch.py).
        return Failure(RequestError.MODEL_NOT_LOADED, message, status, request_id, body)
    if is_retryable_status(status):
        return Failure(code, message, status, request_id, body,
                        parse_retry_after(headers.get("retry-after")),
                        backpressure=is_backpressure_status(status))
    return error_record(custom_id, code, message, status, request_id, body)




def transport_failure(custom_id: str, exc: BaseException) -> dict[str, Any] | Failure:
    if not is_retryable_exception(exc):
        # Not the network and not the server: a bug or an unsendable body.
        return error_record(custom_id, exception_code(exc), describe(exc))
    return Failure(exception_code(exc), describe(exc))


def expired_line(custom_id: str, last: Failure | None) -> dict[str, Any]:
    message = "the batch's completion window ended before this request was answered"
    if last is not None:
        message += f"; its last attempt failed with {last.code}: {last.message}"
    return error_record(custom_id, RequestError.BATCH_EXPIRED, message)


def cancelled_line(custom_id: str, last: Failure | None) -> dict[str, Any]:
    message = "the batch was cancelled before this request was answered"
    if last is not None:
        message += f"; its last attempt failed with {last.code}: {last.message}"
    return error_record(custom_id, RequestError.BATCH_CANCELLED, message)


def rule_stopped_line(custom_id: str, last: Failure | None, rule: str) -> dict[str, Any]:
    message = f"the batch's {rule} stop rule stopped it before this request was answered"
    if last is not None:
        message += f"; its last attempt failed with {last.code}: {last.message}"
    return error_record(custom_id, RequestError.BATCH_STOPPED, message)


def stopped_line(
    custom_id: str, last: Failure | None, cancelled: bool, rule: str | None = None
) -> dict[str, Any]:
    """The line of a request that a stop rule (``rule``), a cancel, else the deadline, stopped
    before it was answered."""
    if rule is not None:
        return rule_stopped_line(custom_id, last, rule)
    return cancelled_line(custom_id, last) if cancelled else expired_line(custom_id, last)


def describe(exc: BaseException) -> str:
    """The exception for an error line: its type and text, without the addresses it names
    (``Cannot connect to host <internal address>``); the task log keeps them."""
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {scrub_addresses(text)}"


_redirects_logged: set[tuple[int, str]] = set()


def _log_redirect(status: int, location: str) -> None:
    if (status, location) not in _redirects_logged and len(_redirects_logged) < 100:
        _redirects_logged.add((status, location))
        log.warning("the endpoint answered HTTP %s redirecting to %r; not followed", status, location)


def _body_id(body: dict[str, Any]) -> str:
    return body["id"] if isinstance(body.get("id"), str) else f"req-{uuid.uuid4().hex}"


def _parse_error_body(raw: bytes) -> Any:
    try:
        return loads(raw)
    except JSONDecodeError:
        return raw[:2000].decode("utf-8", "replace")


def _names_an_unknown_model(body: Any) -> bool:
    """A 404 that says the model is unknown: OpenAI's ``model_not_found``, or vLLM's
    ``NotFoundError`` on ``param: model``, or the same without ``param``. vLLM answers the last
    when the adapter goes between its model check and its adapter lookup (a request that arrived
    as the adapter was unloaded: 4 of 240 in a suite run turned into error lines that way)."""
    detail = body.get("error") if isinstance(body, dict) else None
    if not isinstance(detail, dict):
        return False
    if detail.get("code") == "model_not_found":
        return True
    if detail.get("type") != "NotFoundError":
        return False
    message = str(detail.get("message", ""))
    return detail.get("param") == "model" or _VLLM_UNKNOWN_MODEL.match(message) is not None


_VLLM_UNKNOWN_MODEL = re.compile(r"The model `[^`]*` does not exist")


def _error_of(status: int, body: Any) -> tuple[str, str]:
    """OpenAI-style servers put ``{"error": {"code", "message"}}`` in error bodies; use it."""
    detail = body.get("error") if isinstance(body, dict) else None
    if isinstance(detail, dict):
        code = detail.get("code") or detail.get("type") or http_code(status)
        message = detail.get("message") or f"HTTP {status}"
    else:
        code, message = http_code(status), f"HTTP {status}: {str(body)[:500]}"
    return str(code)[:200], str(message)[:2000]
