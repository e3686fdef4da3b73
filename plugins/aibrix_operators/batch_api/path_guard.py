"""Answer, in OpenAI's error shape, requests for the Batch API whose path Airflow cannot route.

The api-server mounts the Batch API at ``/openai``; Starlette matches a mount with ``.*``,
which does not match a newline, so ``/openai/v1/batches/a%0Ab`` never reaches the app and
Airflow answers ``404 {"detail": "Not Found"}`` — a body the OpenAI SDK cannot read and our
OpenAPI schema does not describe. No id, name or route of ours contains a control
character, so such a path is a bad request: this root middleware answers it with 400
(``invalid_path``) before routing, and passes everything else through untouched.
"""

from __future__ import annotations

import json
import re
from typing import Any

from aibrix_operators.batch_api.errors import error_body

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class ControlCharPathGuard:
    """Pure ASGI middleware (no body buffering, no effect on other paths)."""

    def __init__(self, app: Any, prefix: str = "/openai/") -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope.get("type") == "http" else ""
        if not (path.startswith(self.prefix) and _CONTROL.search(path)):
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(400, "the request path contains control characters; ids and "
                                          "names never do", "invalid_path")).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
