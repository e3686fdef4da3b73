"""Helpers for the core unit tests: build batch lines and files on a real local disk."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aibrix_operators.storage import LocalStorage

CHAT = "/v1/chat/completions"


def request_line(
    custom_id: Any = "req-1",
    model: Any = "m",
    url: Any = CHAT,
    method: Any = "POST",
    pad: int = 0,
    drop: tuple[str, ...] = (),
    body: Any = None,
) -> bytes:
    """One batch input line (with its newline); ``drop`` removes top-level keys."""
    if body is None:
        body = {"model": model, "messages": [{"role": "user", "content": "hi" + "x" * pad}]}
        if model is None:
            del body["model"]
    record = {"custom_id": custom_id, "method": method, "url": url, "body": body}
    for key in drop:
        del record[key]
    return json.dumps(record).encode() + b"\n"


def batch_bytes(n: int, prefix: str = "req", pad: int = 0) -> bytes:
    return b"".join(request_line(f"{prefix}-{i}", pad=pad) for i in range(n))


@pytest.fixture
def storage() -> LocalStorage:
    return LocalStorage()


@pytest.fixture
def write_file(tmp_path: Path) -> Callable[[bytes, str], str]:
    def write(data: bytes, name: str = "input.jsonl") -> str:
        path = tmp_path / name
        path.write_bytes(data)
        return str(path)

    return write


@pytest.fixture
def line() -> Callable[..., bytes]:
    """``request_line`` as a fixture, so test modules need not import conftest."""
    return request_line


@pytest.fixture
def lines() -> Callable[..., bytes]:
    """``batch_bytes`` as a fixture: ``n`` valid chat lines with ids ``prefix-0..n-1``."""
    return batch_bytes
