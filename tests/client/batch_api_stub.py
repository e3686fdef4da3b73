"""A stand-in Batch API for the client's unit tests and bench/cli_client.py: only what the
client calls, in OpenAI's shapes. Run as its own process (so its memory is not the client's):

    python tests/client/batch_api_stub.py --output-mb 128     # prints its port, then serves

The output file is generated as it is sent (never held), so a client that holds it whole is
the only thing that can make memory grow. Uploads are read and counted in 1 MiB pieces.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TypeVar

KEY = "sk-stub"
BATCH_ID = "batch_" + "ab" * 16
CHUNK = 1 << 20
PREFIX = "/openai"  # served at /openai/v1, as the Airflow plugin is


Server = TypeVar("Server", bound=ThreadingHTTPServer)


def send_json(handler: BaseHTTPRequestHandler, status: int, body: dict) -> None:
    """One JSON answer with its length: what every local stub server of the tests sends."""
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


@contextmanager
def served_in_thread(server: Server) -> Iterator[Server]:
    """The server answering from a daemon thread until the block ends, then shut down and closed."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def batch(status: str = "completed", lines: int = 0, **extra: object) -> dict:
    return {"id": BATCH_ID, "object": "batch", "endpoint": "/v1/chat/completions", "errors": None,
            "input_file_id": "file-" + "cd" * 16, "completion_window": "24h", "status": status,
            "output_file_id": "file-out", "error_file_id": None, "created_at": int(time.time()),
            "request_counts": {"total": lines, "completed": lines, "failed": 0}, "metadata": None,
            "monitor_url": "http://ui.example/dags/batch_inference/runs/x", **extra}


def line(i: int, width: int) -> bytes:
    head = b'{"custom_id": "req-%08d", "response": {"status_code": 200, "body": {"pad": "' % i
    tail = b'"}}, "error": null}\n'
    return head + b"x" * (width - len(head) - len(tail)) + tail


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Stub

    def log_message(self, *_: object) -> None:
        pass

    def _json(self, status: int, body: dict) -> None:
        send_json(self, status, body)

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {KEY}":
            return True
        self._drain()
        self._json(401, {"error": {"message": "invalid API key", "type": "invalid_request_error",
                                   "param": None, "code": "invalid_api_key"}})
        return False

    def _drain(self) -> int:
        left, total = int(self.headers.get("Content-Length") or 0), 0
        while left:
            piece = self.rfile.read(min(left, CHUNK))
            if not piece:
                break
            left -= len(piece)
            total += len(piece)
        return total

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if not self._authorized():
            return
        s = self.server
        self.path = self.path.removeprefix(PREFIX)
        if self.path.startswith("/v1/batches/"):
            self._json(200, batch(s.status, s.lines, **s.extra))
        elif self.path.startswith("/v1/batches"):
            self._json(200, {"object": "list", "data": [batch(s.status, s.lines, **s.extra)],
                             "first_id": BATCH_ID,
                             "last_id": BATCH_ID, "has_more": False})
        elif self.path == "/v1/files/file-out/content":
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(s.lines * s.width))
            self.end_headers()
            # One block of whole lines, sent again and again: the stub costs little CPU, so a
            # bench measures the client (custom ids repeat every block; tests check the shape).
            per_block = max(CHUNK // s.width, 1)
            block = b"".join(line(i, s.width) for i in range(per_block))
            for start in range(0, s.lines, per_block):
                n = min(per_block, s.lines - start)
                self.wfile.write(block if n == per_block else block[:n * s.width])
        else:
            self._json(404, {"error": {"message": f"no route {self.path}", "type": "invalid_request_error",
                                       "param": None, "code": "not_found"}})

    def do_POST(self) -> None:  # noqa: N802
        if not self._authorized():
            return
        self.path = self.path.removeprefix(PREFIX)
        if self.path == "/v1/files":
            received = self._drain()
            self.server.uploaded.append(received)
            self._json(200, {"id": "file-" + "cd" * 16, "object": "file", "bytes": received,
                             "created_at": int(time.time()), "filename": "input.jsonl", "purpose": "batch",
                             "status": "processed"})
        elif self.path == "/v1/batches":
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            self._json(200, batch("validating", 0, metadata=body.get("metadata")))
        elif self.path.endswith("/cancel"):
            self._drain()
            self._json(200, batch("cancelling", self.server.lines))
        else:
            self._json(404, {"error": {"message": "no route", "type": "x", "param": None, "code": None}})


class Stub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, lines: int, width: int, status: str) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.lines, self.width, self.status = lines, width, status
        self.uploaded: list[int] = []
        self.extra: dict = {}  # fields the batch object is served with, over batch()'s (tests set it)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-mb", type=float, default=16)
    p.add_argument("--line-bytes", type=int, default=1000)
    p.add_argument("--status", default="completed")
    args = p.parse_args()
    width = args.line_bytes
    stub = Stub(int(args.output_mb * 1e6) // width, width, args.status)
    print(stub.server_address[1], flush=True)
    sys.stdout.close()
    stub.serve_forever()


if __name__ == "__main__":
    main()
