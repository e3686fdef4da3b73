"""Authenticate before a body is read, and bound every body (issue 19, findings 7 and 8).

FastAPI reads and parses a route's JSON body before its dependencies run, so a keyless
256 MiB ``POST /v1/batches`` was read whole and then answered 422. This ASGI layer runs first:
a request to ``/v1/...`` without a valid key is answered 401 before one body byte is read; a
JSON body is read here, bounded (413 past ``max_json_bytes``, whether it declares its length
or is chunked), and handed on; an upload's body is counted as it streams (413 past
``max_upload_bytes``, the file limit plus the multipart envelope).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aibrix_operators.batch_api.auth import authenticate
from aibrix_operators.batch_api.errors import ApiError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

MAX_JSON_BYTES = 1 << 20  # a create-batch body is a few hundred bytes; metadata is bounded too


class RequestLimits:
    def __init__(self, app: Any, keyring: Callable[[], dict[str, str]], max_upload_bytes: Callable[[], int],
                 max_json_bytes: int = MAX_JSON_BYTES) -> None:  # fmt: skip
        self.app = app
        self.keyring = keyring
        self.max_upload_bytes = max_upload_bytes
        self.max_json_bytes = max_json_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = _route_path(scope)
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)  # the schema and docs are public
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        try:
            authenticate(_text(headers.get(b"authorization")), self.keyring())
            if scope["method"] in ("GET", "HEAD", "DELETE"):
                pass  # those routes never read a body
            elif path == "/v1/files":
                receive = _counted(receive, self.max_upload_bytes(), _declared(headers))
            else:
                receive = await _buffered(receive, self.max_json_bytes, _declared(headers))
        except ApiError as exc:
            await _answer(send, exc.status, exc.body())
            return
        await self.app(scope, receive, send)


def _route_path(scope: Scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _text(value: bytes | None) -> str | None:
    return value.decode("latin-1") if value is not None else None


def _declared(headers: dict[bytes, bytes]) -> int | None:
    raw = headers.get(b"content-length")
    return int(raw) if raw is not None and raw.isdigit() else None


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body exceeds the maximum of {limit} bytes", "request_too_large")


async def _buffered(receive: Receive, limit: int, declared: int | None) -> Receive:
    """Read the whole (bounded) body now, and replay it to the app."""
    if declared is not None and declared > limit:
        raise _too_large(limit)
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        more = message.get("more_body", False)
    body, sent = b"".join(chunks), False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return await receive()  # a disconnect, once the app waits for one
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _counted(receive: Receive, limit: int, declared: int | None) -> Receive:
    """Pass the body through as it streams, refusing it once it passes ``limit``."""
    if declared is not None and declared > limit:
        raise _too_large(limit)
    size = 0

    async def counting() -> dict[str, Any]:
        nonlocal size
        message = await receive()
        size += len(message.get("body", b""))
        if size > limit:
            raise _too_large(limit)
        return message

    return counting


async def _answer(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               (b"connection", b"close")]  # fmt: skip
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
