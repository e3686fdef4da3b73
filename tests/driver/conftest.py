"""The driver tests' endpoint: the fake OpenAI server (tests/fake_openai.py) on 127.0.0.1 in a
thread of its own. Each request's body says how to misbehave: ``body["fault"]`` is a list of
actions, one per attempt (the last repeats), and ``body["cid"]`` names the request so the server
counts attempts per id; the actions (ok, slow, hang, 429, 429ra, 500, 503, 400, 404model,
404route, drop, partial, nonjson, badusage, any of them delayed with ``@S``), ``storm`` and
``down()``/``up()`` are listed in that module's docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.fake_openai import FakeOpenAI


@pytest.fixture
def fault_server() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI().start()
    try:
        yield server
    finally:
        server.stop()


def request(cid: str, *fault: str) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                     "cid": cid, "fault": list(fault) or ["ok"]}}  # fmt: skip


@pytest.fixture
def make_request() -> Callable[..., dict[str, Any]]:
    """``make_request(cid, *actions)``: one batch input record for the fault server."""
    return request
