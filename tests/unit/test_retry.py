"""Retry classification and backoff bounds."""

from __future__ import annotations

import random

import aiohttp
import pytest

from aibrix_operators.driver.retry import (
    backoff_delay,
    exception_code,
    is_retryable_exception,
    is_retryable_status,
    parse_retry_after,
)


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504, 599])
def test_retryable_statuses(status):
    assert is_retryable_status(status)


@pytest.mark.parametrize("status", [200, 201, 400, 401, 403, 404, 405, 409, 413, 422, 499, 600])
def test_non_retryable_statuses(status):
    assert not is_retryable_status(status)


@pytest.mark.parametrize(
    "exc, code",
    [
        (TimeoutError(), "timeout"),
        (TimeoutError(), "timeout"),
        (aiohttp.ServerTimeoutError("read timeout"), "timeout"),
        (aiohttp.ServerDisconnectedError(), "connection_error"),
        (aiohttp.ClientConnectionError("refused"), "connection_error"),
        (aiohttp.ClientOSError(104, "reset"), "connection_error"),
        (aiohttp.ClientPayloadError("short body"), "connection_error"),
    ],
)
def test_transient_exceptions_are_retryable(exc, code):
    assert is_retryable_exception(exc)
    assert exception_code(exc) == code


@pytest.mark.parametrize("exc", [ValueError("x"), KeyError("k"), aiohttp.InvalidURL("nope")])
def test_other_exceptions_are_not_retryable(exc):
    assert not is_retryable_exception(exc)
    assert exception_code(exc) == "request_failed"


def test_backoff_is_bounded_by_exponential_cap_and_max():
    rng = random.Random(0)
    for attempt in range(1, 12):
        cap = min(2.0, 0.1 * 2 ** (attempt - 1))
        delays = [backoff_delay(attempt, 0.1, 2.0, rng=rng) for _ in range(300)]
        assert all(0 <= d <= cap for d in delays)
        # full jitter: spread over the range, not a constant
        assert max(delays) > 0.8 * cap and min(delays) < 0.2 * cap


def test_retry_after_is_a_floor_but_capped_by_max():
    rng = random.Random(1)
    assert all(backoff_delay(1, 0.01, 5.0, retry_after=1.5, rng=rng) >= 1.5 for _ in range(50))
    assert all(backoff_delay(1, 0.01, 5.0, retry_after=100, rng=rng) == 5.0 for _ in range(50))


@pytest.mark.parametrize(
    "value, expected",
    [(None, None), ("", None), ("3", 3.0), ("0.25", 0.25), ("-4", 0.0),
     ("Wed, 21 Oct 2015 07:28:00 GMT", None)],
)
def test_parse_retry_after(value, expected):
    assert parse_retry_after(value) == expected
