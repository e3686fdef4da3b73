"""Streaming validation: every error code, the accepted edge cases, the report's shape."""

from __future__ import annotations

import io
import json

import pytest

from aibrix_operators.batch.validation import (
    UTF8_BOM,
    BatchValidationError,
    ValidationLimits,
    validate_stream,
)


def validate(data: bytes, endpoint: str | None = None, reopen: bool = True, **limits):
    return validate_stream(
        io.BytesIO(data), endpoint, ValidationLimits(**limits),
        reopen=(lambda: io.BytesIO(data)) if reopen else None,
    )


def codes(report) -> list[tuple[int | None, str]]:
    return [(e.line, e.code) for e in report.errors]


def test_valid_file_reports_its_shape(lines):
    data = lines(3)
    report = validate(data)
    assert report.ok, report.summary()
    assert (report.endpoint, report.model) == ("/v1/chat/completions", "m")
    assert report.total_requests == 3
    assert report.total_bytes == len(data)
    assert report.last_request_line == 3
    assert report.as_openai_errors() == {"object": "list", "data": [], "total": 0}


def test_blank_trailing_lines_are_accepted(lines):
    report = validate(lines(2) + b"\n\n  \n")
    assert report.ok, report.summary()
    assert report.total_requests == 2
    assert report.last_request_line == 2


def test_missing_final_newline_is_accepted(lines):
    report = validate(lines(2).rstrip(b"\n"))
    assert report.ok, report.summary()
    assert report.total_requests == 2


def test_blank_line_between_requests(lines):
    data = lines(1, "a") + b"\n" + lines(1, "b")
    assert codes(validate(data)) == [(2, "blank_line")]


def test_invalid_json_line(lines, line):
    data = lines(1) + b'{"custom_id": "x", "method": \n' + line("y")
    report = validate(data)
    assert codes(report) == [(2, "invalid_json_line")]
    assert "not valid JSON" in report.errors[0].message


@pytest.mark.parametrize("raw", [b"[1, 2]\n", b'"just a string"\n', b"42\n"])
def test_json_that_is_not_an_object(raw):
    assert codes(validate(raw)) == [(1, "invalid_json_line")]


def test_invalid_encoding(line):
    bad = line("ok-1") + line("bad").replace(b'"bad"', b'"b\xff\xfed"') + line("ok-2")
    report = validate(bad)
    assert codes(report) == [(2, "invalid_encoding")]
    assert "UTF-8" in report.errors[0].message


def test_bom_not_allowed(lines):
    report = validate(UTF8_BOM + lines(2))
    assert codes(report) == [(1, "bom_not_allowed")]


def test_crlf_line_ending(lines):
    data = lines(3).replace(b"\n", b"\r\n")
    assert codes(validate(data)) == [(1, "crlf_line_ending"), (2, "crlf_line_ending"),
                                     (3, "crlf_line_ending")]


def test_line_too_large_is_skipped_without_losing_line_numbers(line):
    data = line("a") + line("huge", pad=5000) + line("b", model="other")
    report = validate(data, max_line_bytes=1000)
    # the oversized line is reported, and the line after it still gets its own number
    assert codes(report) == [(2, "line_too_large"), (3, "mismatched_model")]
    assert report.total_requests == 3


def test_line_size_limit_boundary(line):
    exact = line("a")
    limit = len(exact) - 1  # content bytes, without the newline
    assert validate(exact, max_line_bytes=limit).ok
    over_by_one = line("a", pad=1)
    assert codes(validate(over_by_one, max_line_bytes=limit)) == [(1, "line_too_large")]
    over_by_two = line("a", pad=2)
    assert codes(validate(over_by_two, max_line_bytes=limit)) == [(1, "line_too_large")]


def test_truncated_last_line(lines):
    data = lines(2) + b'{"custom_id": "req-2", "method": "PO'
    report = validate(data)
    assert codes(report) == [(3, "truncated_line")]
    assert "truncated" in report.errors[0].message


@pytest.mark.parametrize("field", ["custom_id", "method", "url", "body"])
def test_missing_required_parameter(line, field):
    report = validate(line("a", drop=(field,)))
    assert codes(report) == [(1, "missing_required_parameter")]
    assert report.errors[0].param == field


@pytest.mark.parametrize(
    "kwargs, param",
    [({"custom_id": 7}, "custom_id"), ({"custom_id": ""}, "custom_id"),
     ({"body": ["not", "an", "object"]}, "body"), ({"body": "text"}, "body")],
)
def test_invalid_parameter_type(line, kwargs, param):
    report = validate(line(**kwargs))
    assert codes(report) == [(1, "invalid_parameter_type")]
    assert report.errors[0].param == param


def test_invalid_method(line):
    report = validate(line(method="GET"))
    assert codes(report) == [(1, "invalid_method")]
    assert report.errors[0].param == "method"


def test_invalid_url(line):
    assert codes(validate(line(url="/v1/images/generations"))) == [(1, "invalid_url")]


def test_mismatched_endpoint_against_first_line(line):
    data = line("a") + line("b", url="/v1/completions")
    assert codes(validate(data)) == [(2, "mismatched_endpoint")]


def test_mismatched_endpoint_against_given_endpoint(line):
    report = validate(line("a"), endpoint="/v1/embeddings")
    assert codes(report) == [(1, "mismatched_endpoint")]


def test_invalid_endpoint_fails_before_reading(line):
    report = validate(line("a"), endpoint="/v1/moderations")
    assert [(e.line, e.code, e.param) for e in report.errors] == [
        (None, "invalid_endpoint", "endpoint")
    ]


@pytest.mark.parametrize("model", [None, "", 5])
def test_missing_model(line, model):
    report = validate(line("a", model=model))
    assert codes(report) == [(1, "missing_model")]
    assert report.errors[0].param == "body.model"


def test_mismatched_model(line):
    data = line("a", model="m1") + line("b", model="m1") + line("c", model="m2")
    report = validate(data)
    assert codes(report) == [(3, "mismatched_model")]
    assert "'m2'" in report.errors[0].message and "'m1'" in report.errors[0].message


@pytest.mark.parametrize("reopen", [True, False])
def test_duplicate_custom_id(line, reopen):
    data = line("a") + line("b") + line("a") + line("c") + line("b") + line("a")
    report = validate(data, reopen=reopen)
    assert codes(report) == [(3, "duplicate_custom_id"), (5, "duplicate_custom_id"),
                             (6, "duplicate_custom_id")]
    assert "line 1" in report.errors[0].message
    assert "line 2" in report.errors[1].message


def test_distinct_ids_are_not_duplicates(lines):
    assert validate(lines(2000)).ok


@pytest.mark.parametrize("reopen", [True, False])
def test_duplicates_found_the_same_when_the_ids_spill_to_bucket_files(line, reopen, monkeypatch):
    """A batch larger than what IdHashLog holds in memory (here 3 pairs) spills its id hashes
    to bucket files in chunks; duplicates in different chunks, in the same chunk and across
    the end are found exactly as in memory, each naming its first line."""
    from aibrix_operators.batch import duplicate_ids

    ids = ["a", "b", "c", "a", "d", "e", "f", "b", "g", "a", "h", "c", "d"]
    data = b"".join(line(i) for i in ids)
    in_memory = codes(validate(data, reopen=reopen))
    messages = [e.message for e in validate(data, reopen=reopen).errors]
    spilled = []
    real_spill = duplicate_ids.IdHashLog.spill

    def spill(self):
        spilled.append(len(self.hashes))
        real_spill(self)

    monkeypatch.setattr(duplicate_ids, "SPILL_AT", 3)
    monkeypatch.setattr(duplicate_ids.IdHashLog, "spill", spill)
    report = validate(data, reopen=reopen)
    assert spilled == [3, 3, 3, 3, 1]  # four full chunks, then the rest at the end
    assert codes(report) == in_memory == [(4, "duplicate_custom_id"), (8, "duplicate_custom_id"),
                                          (10, "duplicate_custom_id"), (12, "duplicate_custom_id"),
                                          (13, "duplicate_custom_id")]
    assert [e.message for e in report.errors] == messages
    assert "line 1" in messages[0] and "line 2" in messages[1] and "line 3" in messages[3]
    assert validate(b"".join(line(f"id-{i}") for i in range(50)), reopen=reopen).ok  # no false alarm


def test_spilled_ids_keep_64_bit_hashes_and_line_numbers_past_2_gib():
    """The bucket files keep whole 64-bit hashes (negative ones too: the bucket is the top bits of
    the unsigned value) and 8-byte line numbers."""
    from aibrix_operators.batch.duplicate_ids import IdHashLog

    log = IdHashLog(spill_at=2)
    pairs = [(-1, 1), (2**63 - 1, 2), (-(2**63), 3), (-1, 2**40), (5, 2**33), (2**63 - 1, 7)]
    for h, n in pairs:
        log.hashes.append(h)
        log.lines.append(n)
        if len(log.hashes) == log.spill_at:
            log.spill()
    assert log.spilled
    assert log.colliding() == {1: -1, 2**40: -1, 2: 2**63 - 1, 7: 2**63 - 1}


def test_too_many_requests(lines):
    report = validate(lines(5), max_requests=3)
    assert codes(report) == [(4, "too_many_requests")]
    assert report.errors[0].param == "max_requests"
    assert validate(lines(3), max_requests=3).ok


def test_file_too_large(lines):
    data = lines(10)
    report = validate(data, max_file_bytes=len(data) - 1)
    assert [(e.code, e.param) for e in report.errors] == [("file_too_large", "max_file_bytes")]
    assert validate(data, max_file_bytes=len(data)).ok


@pytest.mark.parametrize("data", [b"", b"\n", b"\n\n   \n"])
def test_empty_file(data):
    assert codes(validate(data)) == [(None, "empty_file")]


def test_errors_report_shape_and_cap(line):
    data = b"".join(line(f"id-{i}", method="GET") for i in range(10))
    report = validate(data, max_reported_errors=3)
    assert not report.ok
    errors = report.as_openai_errors()
    assert errors["object"] == "list"
    assert errors["total"] == 10
    assert len(errors["data"]) == 3
    for n, item in enumerate(errors["data"], start=1):
        assert set(item) == {"code", "message", "param", "line"}
        assert item["line"] == n and item["code"] == "invalid_method"
    json.dumps(errors)  # serializable as is, for batch.json
    summary = report.summary()
    assert "10 error(s)" in summary
    assert "line 1: [invalid_method]" in summary
    assert "and 7 more" in summary


def test_several_errors_on_one_line_and_exception_carries_report(line):
    report = validate(line(7, method="PUT", url="/v2/x", model=None))
    assert sorted(e.code for e in report.errors) == [
        "invalid_method", "invalid_parameter_type", "invalid_url", "missing_model"]
    exc = BatchValidationError(report)
    assert exc.report is report
    assert "invalid_url" in str(exc)


def test_a_run_of_blank_lines_is_one_error_with_its_extent(lines):
    data = lines(1, "a") + b"\n" * 5 + b"  \n" + lines(1, "b") + b"\n" + lines(1, "c")
    report = validate(data)
    assert codes(report) == [(2, "blank_line"), (9, "blank_line")]
    assert "6 blank lines (lines 2-7)" in report.errors[0].message
    assert report.errors[1].message == "blank line between requests; remove it"
    assert report.last_request_line == 10


def test_blank_run_through_a_buffered_stream_keeps_line_numbers_and_byte_counts(lines, tmp_path):
    # A real file is a BufferedReader, whose peek() lets a newline run be skipped in chunks.
    data = lines(1, "a") + b"\n" * 3_000_000 + lines(1, "b", ) + b"\n" * 10
    path = tmp_path / "in.jsonl"
    path.write_bytes(data)
    with open(path, "rb", buffering=1 << 20) as fh:
        report = validate_stream(fh, None, ValidationLimits())
    assert codes(report) == [(2, "blank_line")]
    assert "3000000 blank lines (lines 2-3000001)" in report.errors[0].message
    assert report.last_request_line == 3_000_002
    assert report.total_bytes == len(data)
    with open(path, "rb", buffering=1 << 20) as fh:
        too_big = validate_stream(fh, None, ValidationLimits(max_file_bytes=1_000_000))
    assert [(e.code, e.param) for e in too_big.errors] == [("file_too_large", "max_file_bytes")]
    first_line = len(lines(1, "a"))
    # The limit is crossed inside the run: the message names the exact line (one byte each).
    assert f"exceeded at line {1_000_000 - first_line + 2}" in too_big.errors[0].message


def test_echoed_values_are_cut(line):
    huge = "G" * 100_000
    data = line("a", method=huge) + line("b", url="/" + huge) + line("c", model="m" + huge)
    report = validate(data)
    assert codes(report) == [(1, "invalid_method"), (2, "invalid_url"), (3, "mismatched_model")]
    for error in report.errors:
        assert len(error.message) < 500, error.message[:600]
    assert "(100000 characters)" in report.errors[0].message
    assert len(report.summary()) < 2000


def test_duplicate_ids_are_echoed_cut(line):
    cid = "d" * 50_000
    report = validate(line(cid) + line(cid))
    assert codes(report) == [(2, "duplicate_custom_id")]
    assert len(report.errors[0].message) < 500


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_nan_and_infinity_are_rejected_with_their_own_code(line, literal):
    bad = line("x").replace(b'"messages"', b'"temperature": ' + literal + b', "messages"')
    report = validate(line("a") + bad)
    assert codes(report) == [(2, "invalid_number")]
    assert "finite" in report.errors[0].message


@pytest.mark.parametrize("escape", [b"\\ud800", b"\\udfff", b"\\ud83d tail"])
def test_lone_surrogates_are_rejected_with_their_own_code(line, escape):
    bad = line("x").replace(b'"hi"', b'"hi ' + escape + b'"')
    report = validate(bad + line("b"))
    assert codes(report) == [(1, "lone_surrogate")]


def test_a_surrogate_pair_is_fine(line):
    assert validate(line("x").replace(b'"hi"', b'"hi \\ud83d\\ude00"')).ok


def test_invalid_json_message_is_bounded(lines):
    data = lines(1) + b'{"custom_id": "' + b"q" * 300_000 + b'", oops}\n'
    report = validate(data)
    assert codes(report) == [(2, "invalid_json_line")]
    assert len(report.errors[0].message) <= 1100


def test_jsonfast_is_orjson():
    import orjson

    from aibrix_operators.batch import jsonfast

    assert jsonfast.loads is orjson.loads and jsonfast.dumps is orjson.dumps
    with pytest.raises(jsonfast.JSONDecodeError):
        jsonfast.loads(b'{"a": NaN}')
