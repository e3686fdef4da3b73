"""/v1/responses, /v1/score, /v1/rerank: valid lines pass, each body mistake is its line's error.

The bodies are the shapes vLLM 0.32's request models take (ResponsesRequest, the four
ScoreRequest forms, RerankRequest); what they refuse by type is refused here with the line's
number, code and param, before any inference."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from aibrix_operators.batch.records import SUPPORTED_ENDPOINTS, Usage
from aibrix_operators.batch.validation import ValidationLimits, validate_stream
from aibrix_operators.batch_api.batches import check_endpoint
from aibrix_operators.batch_api.errors import ApiError

RESPONSES, SCORE, RERANK = "/v1/responses", "/v1/score", "/v1/rerank"

VALID: dict[str, list[dict[str, Any]]] = {
    RESPONSES: [
        {"input": "hello"},
        {"input": [{"role": "user", "content": "hi"}], "instructions": "be brief",
         "max_output_tokens": 8, "stream": False, "background": False},
    ],
    SCORE: [
        {"queries": "q", "documents": ["a", "b"]},
        {"queries": ["q1", "q2"], "items": ["a", "b"]},
        {"text_1": "q", "text_2": "a"},
        {"data_1": {"content": [{"type": "text", "text": "q"}]}, "data_2": ["a"]},
    ],
    RERANK: [
        {"query": "q", "documents": ["a", "b"], "top_n": 1},
        {"query": "q", "documents": "a"},
        {"query": {"content": [{"type": "text", "text": "q"}]}, "documents": ["a"], "top_n": 0},
    ],
}

# (endpoint, body without model, the (code, param) of each error the line gets)
INVALID: list[tuple[str, dict[str, Any], list[tuple[str, str]]]] = [
    (RESPONSES, {}, [("missing_body_field", "body.input")]),
    (RESPONSES, {"input": 7}, [("invalid_body_field", "body.input")]),
    (RESPONSES, {"input": []}, [("invalid_body_field", "body.input")]),
    (RESPONSES, {"input": ["not an item"]}, [("invalid_body_field", "body.input")]),
    (RESPONSES, {"input": "x", "instructions": ["a"]}, [("invalid_body_field", "body.instructions")]),
    (RESPONSES, {"input": "x", "max_output_tokens": "8"}, [("invalid_body_field", "body.max_output_tokens")]),
    (RESPONSES, {"input": "x", "max_output_tokens": True},
     [("invalid_body_field", "body.max_output_tokens")]),
    (RESPONSES, {"input": "x", "stream": True}, [("not_supported_in_batch", "body.stream")]),
    (RESPONSES, {"input": "x", "background": True}, [("not_supported_in_batch", "body.background")]),
    (SCORE, {}, [("missing_body_field", "body.queries")]),
    (SCORE, {"queries": "q"}, [("missing_body_field", "body.documents")]),
    (SCORE, {"text_1": "q"}, [("missing_body_field", "body.text_2")]),
    (SCORE, {"text_2": "a"}, [("missing_body_field", "body.text_1")]),
    (SCORE, {"queries": "q", "documents": []}, [("invalid_body_field", "body.documents")]),
    (SCORE, {"queries": 3, "documents": ["a", 4]},
     [("invalid_body_field", "body.queries"), ("invalid_body_field", "body.documents")]),
    (SCORE, {"text_1": {"text": "q"}, "text_2": "a"}, [("invalid_body_field", "body.text_1")]),
    (RERANK, {}, [("missing_body_field", "body.query"), ("missing_body_field", "body.documents")]),
    (RERANK, {"query": "q"}, [("missing_body_field", "body.documents")]),
    (RERANK, {"query": ["q"], "documents": ["a"]}, [("invalid_body_field", "body.query")]),
    (RERANK, {"query": "q", "documents": [1]}, [("invalid_body_field", "body.documents")]),
    (RERANK, {"query": "q", "documents": ["a"], "top_n": -1}, [("invalid_body_field", "body.top_n")]),
    (RERANK, {"query": "q", "documents": ["a"], "top_n": 1.5}, [("invalid_body_field", "body.top_n")]),
    (RERANK, {"query": "q", "documents": ["a"], "top_n": True}, [("invalid_body_field", "body.top_n")]),
]


def line(custom_id: str, url: str, body: dict[str, Any]) -> bytes:
    record = {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", **body}}
    return json.dumps(record).encode() + b"\n"


def validate(data: bytes, endpoint: str | None = None):
    return validate_stream(io.BytesIO(data), endpoint, ValidationLimits(),
                           reopen=lambda: io.BytesIO(data))


@pytest.mark.parametrize("url", [RESPONSES, SCORE, RERANK])
def test_valid_lines_of_each_new_endpoint_pass(url: str) -> None:
    data = b"".join(line(f"r{i}", url, body) for i, body in enumerate(VALID[url]))
    report = validate(data)
    assert report.ok, report.summary()
    assert (report.endpoint, report.total_requests) == (url, len(VALID[url]))
    # Given as the batch's endpoint (the Batch API's, a trigger's batch_endpoint) too.
    assert validate(data, url).ok


@pytest.mark.parametrize(("url", "body", "expected"), INVALID)
def test_each_body_mistake_is_its_lines_error(url: str, body: dict, expected: list) -> None:
    # The bad line is the second: its number is reported, the valid first line is not.
    data = line("good", url, VALID[url][0]) + line("bad", url, body) + line("good-2", url, VALID[url][0])
    report = validate(data)
    assert [(e.line, e.code, e.param) for e in report.errors] == [(2, c, p) for c, p in expected]
    assert all(e.message for e in report.errors)


def test_first_line_bad_body_is_found_too() -> None:
    # The first line sets the endpoint and model, so it goes through the full checks.
    report = validate(line("a", RERANK, {"query": "q"}) + line("b", RERANK, VALID[RERANK][0]))
    assert [(e.line, e.code) for e in report.errors] == [(1, "missing_body_field")]


def test_a_line_is_checked_against_its_own_url_not_the_batch_endpoint() -> None:
    # A chat line in a score batch is one mismatched_endpoint, not also a missing score pair.
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    report = validate(line("a", SCORE, VALID[SCORE][0]) + line("b", "/v1/chat/completions", chat))
    assert [(e.line, e.code) for e in report.errors] == [(2, "mismatched_endpoint")]
    # A bad rerank line in a score batch: both of its problems.
    report = validate(line("a", SCORE, VALID[SCORE][0]) + line("b", RERANK, {"query": "q"}))
    assert [(e.line, e.code) for e in report.errors] == [(2, "mismatched_endpoint"),
                                                         (2, "missing_body_field")]


@pytest.mark.parametrize(("alias", "canonical"), [("/score", SCORE), ("/rerank", RERANK),
                                                  ("/v2/rerank", RERANK)])
def test_vllm_aliases_are_refused_naming_the_v1_endpoint(alias: str, canonical: str) -> None:
    report = validate(line("a", alias, VALID[canonical][0]))
    assert [(e.line, e.code, e.param) for e in report.errors] == [(1, "invalid_url", "url")]
    assert f"use {canonical}" in report.errors[0].message


def test_the_old_endpoints_keep_their_unchecked_bodies() -> None:
    # No body checks for chat/completions/embeddings: the server judges those bodies, as before.
    for url in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        assert validate(line("a", url, {"stream": True})).ok


def test_the_batch_api_and_the_dag_param_accept_the_new_endpoints() -> None:
    for url in (RESPONSES, SCORE, RERANK):
        assert url in SUPPORTED_ENDPOINTS
        assert check_endpoint(url) == url
    with pytest.raises(ApiError):
        check_endpoint("/v1/audio/transcriptions")


def test_responses_usage_counts_in_the_batch_totals() -> None:
    usage = Usage()
    usage.add_response_body({"object": "response", "usage": {
        "input_tokens": 11, "output_tokens": 4, "total_tokens": 15,
        "input_tokens_details": {"cached_tokens": 3}, "output_tokens_details": {"reasoning_tokens": 0}}})
    usage.add_response_body({"object": "list", "usage": {"prompt_tokens": 5, "total_tokens": 5}})  # rerank
    assert (usage.input_tokens, usage.output_tokens, usage.cached_tokens) == (16, 4, 3)


def test_the_health_replay_of_a_responses_request_asks_for_one_token() -> None:
    # The breaker's probe replays an answered request; for /v1/responses the limit is
    # max_output_tokens (max_tokens would be ignored and the probe cost a whole answer).
    from aibrix_operators.driver.preflight import _one_token

    payload = json.dumps({"model": "m", "input": "hi", "max_output_tokens": 500, "stream": False}).encode()
    assert json.loads(_one_token("http://h/v1/responses", payload)) == {
        "model": "m", "input": "hi", "max_output_tokens": 1, "stream": False}
    pooled = json.dumps({"model": "m", "query": "q", "documents": ["a"]}).encode()
    assert _one_token("http://h/v1/rerank", pooled) == pooled
