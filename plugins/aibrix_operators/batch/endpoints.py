"""What each endpoint requires of a line's ``body``, checked by validation before any inference.

The schemas are vLLM 0.32's (``ResponsesRequest``, ``ScoreRequest``, ``RerankRequest``): a line
that fails here would be a 400 from the server, one request at a time, after the batch had
started; caught here it is a line-numbered error before anything is sent. Only what vLLM
requires, and the types it would refuse, are checked; values within a type (a ``top_n`` larger
than the documents, an unknown ``tool_choice``) stay the server's to judge.

``/v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings`` have no body checks here
(``check_body`` returns nothing for them): their lines take validation's fast path unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aibrix_operators.batch.error_codes import ValidationCode

RESPONSES = "/v1/responses"
SCORE = "/v1/score"
RERANK = "/v1/rerank"

# vLLM's server also routes these, and its run_batch matches any url ending in /score or
# /rerank; a batch names one canonical endpoint, so a line using one is told which.
VLLM_ALIASES: dict[str, str] = {"/score": SCORE, "/rerank": RERANK, "/v2/rerank": RERANK}

# (code, message, param): one problem of a body, reported with the line's number.
BodyProblem = tuple[str, str, str]

# vLLM's score request takes one of these pairs (ScoreQueriesDocumentsRequest first).
SCORE_PAIRS: tuple[tuple[str, str], ...] = (
    ("queries", "documents"), ("queries", "items"), ("text_1", "text_2"), ("data_1", "data_2"),
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _score_input_problem(value: Any) -> str | None:
    """Why ``value`` is not one of vLLM's ``ScoreInput`` (a string, or ``{"content": [...]}``)."""
    if isinstance(value, str):
        return None
    if isinstance(value, dict):
        return None if isinstance(value.get("content"), list) else "an object must have a content list"
    return f"must be a string or an object with a content list, not {type(value).__name__}"


def _score_inputs_problem(value: Any) -> str | None:
    """Why ``value`` is neither a ``ScoreInput`` nor a non-empty list of them."""
    if isinstance(value, list):
        if not value:
            return "must not be an empty list"
        for i, item in enumerate(value):
            problem = _score_input_problem(item)
            if problem is not None:
                return f"item {i} {problem}"
        return None
    if _score_input_problem(value) is None:
        return None
    return f"must be a string, an object with a content list, or a list of them, not {type(value).__name__}"


def _unsupported_in_batch(body: dict[str, Any], *fields: str) -> list[BodyProblem]:
    # A streamed answer is server-sent events, not the one JSON object a result line holds; a
    # background response is a "queued" placeholder whose answer would never reach the batch.
    return [
        (ValidationCode.NOT_SUPPORTED_IN_BATCH,
         f"body.{name} is true; a batch request gets one complete answer: remove {name} or set it "
         "to false", f"body.{name}")
        for name in fields if body.get(name) is True
    ]


def _responses(body: dict[str, Any]) -> list[BodyProblem]:
    problems: list[BodyProblem] = []
    value = body.get("input")
    if value is None:
        problems.append((ValidationCode.MISSING_BODY_FIELD,
                         "body.input is missing; a /v1/responses request needs input (a string, or a "
                         "list of input items)", "body.input"))
    elif isinstance(value, list):
        bad = next((i for i, item in enumerate(value) if not isinstance(item, dict)), None)
        if not value or bad is not None:
            where = "is an empty list" if not value else f"item {bad} is not an object"
            problems.append((ValidationCode.INVALID_BODY_FIELD,
                             f"body.input {where}; it must be a string or a list of input items "
                             "(objects such as {\"role\": \"user\", \"content\": \"...\"})", "body.input"))
    elif not isinstance(value, str):
        problems.append((ValidationCode.INVALID_BODY_FIELD,
                         f"body.input must be a string or a list of input items, not "
                         f"{type(value).__name__}", "body.input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        problems.append((ValidationCode.INVALID_BODY_FIELD, "body.instructions must be a string",
                         "body.instructions"))
    limit = body.get("max_output_tokens")
    if limit is not None and (not _is_int(limit) or limit < 1):
        problems.append((ValidationCode.INVALID_BODY_FIELD,
                         "body.max_output_tokens must be a positive integer", "body.max_output_tokens"))
    return problems + _unsupported_in_batch(body, "stream", "background")


def _score(body: dict[str, Any]) -> list[BodyProblem]:
    pair = next((p for p in SCORE_PAIRS if p[0] in body and p[1] in body), None)
    if pair is None:
        present = next((p for p in SCORE_PAIRS if p[0] in body or p[1] in body), SCORE_PAIRS[0])
        missing = present[1] if present[0] in body else present[0]
        return [(ValidationCode.MISSING_BODY_FIELD,
                 f"body.{missing} is missing; a /v1/score request needs queries and documents "
                 "(or text_1 and text_2, data_1 and data_2, queries and items)", f"body.{missing}")]
    problems: list[BodyProblem] = []
    for name in pair:
        problem = _score_inputs_problem(body[name])
        if problem is not None:
            problems.append((ValidationCode.INVALID_BODY_FIELD, f"body.{name} {problem}", f"body.{name}"))
    return problems


def _rerank(body: dict[str, Any]) -> list[BodyProblem]:
    problems: list[BodyProblem] = []
    for name, check in (("query", _score_input_problem), ("documents", _score_inputs_problem)):
        if name not in body or body[name] is None:
            problems.append((ValidationCode.MISSING_BODY_FIELD,
                             f"body.{name} is missing; a /v1/rerank request needs query (a string) and "
                             "documents (a list of strings)", f"body.{name}"))
            continue
        problem = check(body[name])
        if problem is not None:
            problems.append((ValidationCode.INVALID_BODY_FIELD, f"body.{name} {problem}", f"body.{name}"))
    top_n = body.get("top_n")
    if top_n is not None and (not _is_int(top_n) or top_n < 0):
        problems.append((ValidationCode.INVALID_BODY_FIELD,
                         "body.top_n must be a non-negative integer (0: all documents)", "body.top_n"))
    return problems


# The endpoints whose bodies are checked; the others take validation's fast path as before.
BODY_CHECKS: dict[str, Callable[[dict[str, Any]], list[BodyProblem]]] = {
    RESPONSES: _responses, SCORE: _score, RERANK: _rerank,
}


def check_body(url: str, body: dict[str, Any]) -> list[BodyProblem]:
    """The problems of ``body`` for the endpoint ``url`` (none for an endpoint without checks)."""
    check = BODY_CHECKS.get(url)
    return check(body) if check is not None else []
