"""OpenAI's Files and Batches API as ``FakeOpenAI`` serves it (``fake.batches``): in memory, the
parts a batch client uses, in OpenAI's shapes — and, like OpenAI, no Idempotency-Key.

Each request line is answered with what the fake's online endpoint answers for it
(``answer_for``), so a batch's output is predictable line by line. A batch is ``validating``
when created, ``in_progress`` at its first retrieve and ends at its ``polls_to_finish``-th:
``completed``, or ``failed`` when a line names a model in ``unknown_models`` (an error per such
line, OpenAI's ``errors`` list). ``drop_create_responses = n`` makes the next n creates happen
but cut the connection before their answer (the client sees a lost response).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from aiohttp import web

KEY_HEADER = "Authorization"
TERMINAL = ("completed", "failed", "expired", "cancelled")


class BatchService:
    def __init__(self, key: str | None = None, polls_to_finish: int = 2, model: str = "m") -> None:
        self.key = key
        self.polls_to_finish = polls_to_finish
        self.model = model
        self.unknown_models: set[str] = set()
        self.drop_create_responses = 0
        self.files: dict[str, dict[str, Any]] = {}
        self.contents: dict[str, bytes] = {}
        self.batches: dict[str, dict[str, Any]] = {}  # in creation order
        self.polls: dict[str, int] = {}
        self.creates: list[dict[str, Any]] = []  # every create request's body, as received
        self.lock = threading.Lock()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/files", self._upload)
        app.router.add_get("/v1/files/{id}/content", self._content)
        app.router.add_post("/v1/batches", self._create)
        app.router.add_get("/v1/batches", self._list)
        app.router.add_get("/v1/batches/{id}", self._retrieve)
        app.router.add_post("/v1/batches/{id}/cancel", self._cancel)

    # ------------------------------------------------------------------ helpers
    def _refused(self, request: web.Request) -> web.Response | None:
        if self.key is None or request.headers.get(KEY_HEADER) == f"Bearer {self.key}":
            return None
        return _error(401, "invalid_api_key", "Incorrect API key provided")

    def _new_file(self, data: bytes, name: str, purpose: str) -> dict[str, Any]:
        file_id = f"file-{len(self.files) + 1:06d}"
        self.files[file_id] = {"id": file_id, "object": "file", "bytes": len(data), "filename": name,
                               "created_at": int(time.time()), "purpose": purpose, "status": "processed"}
        self.contents[file_id] = data
        return self.files[file_id]

    def _advance(self, batch: dict[str, Any]) -> None:
        """One retrieve's worth of progress."""
        if batch["status"] in TERMINAL:
            return
        self.polls[batch["id"]] = polls = self.polls.get(batch["id"], 0) + 1
        if polls < self.polls_to_finish:
            batch["status"] = "in_progress"
            batch["in_progress_at"] = batch["in_progress_at"] or int(time.time())
            return
        self._finish(batch)

    def _finish(self, batch: dict[str, Any]) -> None:
        from tests.fake_openai import answer_for

        lines = [json.loads(x) for x in self.contents[batch["input_file_id"]].splitlines() if x.strip()]
        unknown = [(n, r) for n, r in enumerate(lines, 1) if r["body"].get("model") in self.unknown_models]
        now = int(time.time())
        batch["request_counts"] = {"total": len(lines), "completed": 0, "failed": 0}
        if unknown:
            batch.update(status="failed", failed_at=now, errors={"object": "list", "data": [
                {"code": "model_not_found", "line": n, "param": "body.model",
                 "message": f"The model {r['body']['model']!r} does not exist"} for n, r in unknown]})
            return
        out = b"".join(json.dumps({
            "id": f"batch_req_{i}", "custom_id": r["custom_id"], "error": None,
            "response": {"status_code": 200, "request_id": f"req_{i}",
                         "body": answer_for(r["url"], r["custom_id"], 1, r["body"].get("model", self.model))},
        }).encode() + b"\n" for i, r in enumerate(lines))
        batch["output_file_id"] = self._new_file(out, "output.jsonl", "batch_output")["id"]
        batch["request_counts"]["completed"] = len(lines)
        batch.update(status="completed", finalizing_at=now, completed_at=now)

    # ------------------------------------------------------------------ handlers
    async def _upload(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request)) is not None:
            return refused
        form = await request.post()
        upload = form["file"]
        data = upload.file.read()  # type: ignore[union-attr]
        with self.lock:
            return web.json_response(self._new_file(data, upload.filename, str(form["purpose"])))  # type: ignore[union-attr]

    async def _content(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request)) is not None:
            return refused
        data = self.contents.get(request.match_info["id"])
        if data is None:
            return _error(404, "not_found", "No such File object")
        return web.Response(body=data, content_type="application/octet-stream")

    async def _create(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request)) is not None:
            return refused
        body = await request.json()
        with self.lock:
            self.creates.append(body)
            if body.get("input_file_id") not in self.files:
                return _error(404, "not_found", f"No such File object: {body.get('input_file_id')}")
            batch_id = f"batch_{len(self.batches) + 1:06d}"
            now = int(time.time())
            self.batches[batch_id] = batch = {
                "id": batch_id, "object": "batch", "endpoint": body["endpoint"], "errors": None,
                "input_file_id": body["input_file_id"], "completion_window": body["completion_window"],
                "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": now,
                "in_progress_at": None, "expires_at": now + 86400, "finalizing_at": None,
                "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
                "cancelled_at": None,
                "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": body.get("metadata"),
            }
            drop = self.drop_create_responses > 0
            self.drop_create_responses -= drop
        if drop:  # the batch exists; its creator never hears of it
            assert request.transport is not None
            request.transport.abort()
        return web.json_response(batch)

    async def _list(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request)) is not None:
            return refused
        limit = int(request.query.get("limit", 20))
        with self.lock:
            newest_first = list(reversed(self.batches.values()))
        after = request.query.get("after")
        if after is not None:
            ids = [b["id"] for b in newest_first]
            newest_first = newest_first[ids.index(after) + 1:] if after in ids else []
        page = newest_first[:limit]
        return web.json_response({"object": "list", "data": page, "has_more": len(newest_first) > limit,
                                  "first_id": page[0]["id"] if page else None,
                                  "last_id": page[-1]["id"] if page else None})

    async def _retrieve(self, request: web.Request) -> web.Response:
        return self._on_batch(request, self._advance)

    async def _cancel(self, request: web.Request) -> web.Response:
        def cancel(batch: dict[str, Any]) -> None:
            if batch["status"] not in TERMINAL:
                batch.update(status="cancelled", cancelled_at=int(time.time()))

        return self._on_batch(request, cancel)

    def _on_batch(self, request: web.Request, change: Any) -> web.Response:
        """The batch the path names, after ``change(batch)``; 401 or 404 as OpenAI answers."""
        if (refused := self._refused(request)) is not None:
            return refused
        with self.lock:
            batch = self.batches.get(request.match_info["id"])
            if batch is None:
                return _error(404, "not_found", "No such Batch object")
            change(batch)
            return web.json_response(batch)


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error",
                                        "param": None, "code": code}}, status=status)
