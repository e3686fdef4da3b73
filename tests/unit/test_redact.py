"""Addresses never reach a batch's submitter (finding 13, and a second review's variants)."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from aibrix_operators.driver.answers import Failure, describe, expired_line
from aibrix_operators.trust.redact import INTERNAL, scrub_addresses, scrub_json


@pytest.mark.parametrize("text, gone", [
    ("Cannot connect to host vllm-router.batch.svc.invalid:37011 ssl:default", "vllm-router"),
    ("[Connect call failed ('::1', 8000, 0, 0)]", "::1"),
    ("Cannot connect to host [fd00::7]:8000", "fd00::7"),
    ("redirect to '//internal-admin.batch.svc:9000/x'", "internal-admin"),
    ("http://10.0.3.7:8000/v1 failed", "10.0.3.7"),
    ("s3://internal-bucket/out failed", "internal-bucket"),
    ("link fe80::1%eth0 down", "fe80::1"),
    ("host localhost:8000 refused", "localhost:8000"),
])
def test_addresses_are_scrubbed(text: str, gone: str) -> None:
    out = scrub_addresses(text)
    assert gone not in out and INTERNAL in out, out


@pytest.mark.parametrize("text", [
    "the batch's completion window ended at 12:30", "ratio 1:2", "HTTP 503: upstream busy",
    "max_tokens must be <= 2048: got 100000", "invalid_json_line at line 5",
    "ServerDisconnectedError: Server disconnected", "a:b:c is not an address",
])
def test_plain_messages_are_left_alone(text: str) -> None:
    assert scrub_addresses(text) == text


def test_json_bodies_are_scrubbed_leaf_by_leaf() -> None:
    body = {"error": {"message": "upstream http://10.0.0.9:8000 down", "code": 503}, "n": [1, "vllm:8000"]}
    assert scrub_json(body) == {"error": {"message": f"upstream {INTERNAL} down", "code": 503},
                                "n": [1, INTERNAL]}


async def _connector_error() -> BaseException:
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with aiohttp.ClientSession() as session:
        try:
            await session.get(f"http://localhost:{port}/v1/models")
        except aiohttp.ClientError as exc:
            return exc
    raise AssertionError("connected to a closed port")


def test_an_expired_line_names_the_last_failure_without_its_address() -> None:
    exc = asyncio.run(_connector_error())
    assert "localhost" in str(exc) or "127.0.0.1" in str(exc)  # what aiohttp itself says
    line = expired_line("req-1", Failure("connection_error", describe(exc)))
    message = line["error"]["message"]
    assert message.startswith("the batch's completion window ended") and type(exc).__name__ in message
    assert "localhost" not in message and "127.0.0.1" not in message, message
