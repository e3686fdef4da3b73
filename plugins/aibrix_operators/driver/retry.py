"""Which failures are worth another attempt, and how long to wait before it."""

from __future__ import annotations

import asyncio
import random

import aiohttp

from aibrix_operators.batch.error_codes import RequestError

# 408 Request Timeout, 429 Too Many Requests and 5xx; every other 4xx is the request's
# own fault and would fail the same way again.
RETRYABLE_STATUS = frozenset({408, 429})
# The server is alive and asks us to slow down: waited out, never charged to the request.
BACKPRESSURE_STATUS = frozenset({408, 429})


def is_retryable_status(status: int) -> bool:
    return status in RETRYABLE_STATUS or 500 <= status <= 599


def is_backpressure_status(status: int) -> bool:
    return status in BACKPRESSURE_STATUS


def is_retryable_exception(exc: BaseException) -> bool:
    """Timeouts and broken connections are transient; anything else is a bug or bad input."""
    return isinstance(
        exc,
        asyncio.TimeoutError
        | aiohttp.ServerTimeoutError
        | aiohttp.ClientConnectionError
        | aiohttp.ClientPayloadError,
    )


def exception_code(exc: BaseException) -> RequestError:
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return RequestError.TIMEOUT
    if isinstance(exc, aiohttp.ClientConnectionError | aiohttp.ClientPayloadError):
        return RequestError.CONNECTION_ERROR
    return RequestError.REQUEST_FAILED


def backoff_delay(
    attempt: int, base_s: float, max_s: float, retry_after: float | None = None,
    rng: random.Random | None = None,
) -> float:
    """Exponential backoff with full jitter; a server's Retry-After is a floor."""
    cap = min(max_s, base_s * (2 ** (attempt - 1)))
    delay = (rng or random).uniform(0, cap)
    if retry_after is not None:
        delay = max(delay, min(retry_after, max_s))
    return delay


def parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # HTTP-date form: fall back to our own backoff
