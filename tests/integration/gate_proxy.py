"""A pass-through HTTP proxy in front of a real vLLM server that can hold requests.

Chaos tests need a driver pod caught *mid-shard*: some answers checkpointed, more still to
send. With a tiny model a 20-request shard can finish within one checkpoint interval, so
watching for the first checkpoint and then killing is a race the pod may win. The gate makes
it deterministic: ``hold_after(n)`` lets ``n`` more completion requests through, then holds
the rest until ``release()``; GETs (the driver's probes) always pass.
"""

from __future__ import annotations

import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        # A sender killed mid-request (what the chaos tests do) resets its connection.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class GateProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self._cond = threading.Condition()
        self._forwarded = 0
        self._hold_at: int | None = None  # forwarded count at which requests start to wait
        self._generation = 0  # bumped by drop_held: requests held before it are not forwarded
        self.held = 0  # requests waiting now
        gate = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet: pytest shows failures only
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                self._forward(None)

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if gate._admit():
                    self._forward(body)
                else:
                    self._answer(503, "application/json", b'{"error": "dropped by the test gate"}')

            def _forward(self, body: bytes | None) -> None:
                request = urllib.request.Request(
                    gate.upstream + self.path, data=body, method=self.command,
                    headers={"Content-Type": self.headers.get("Content-Type", "application/json")},
                )  # fmt: skip
                try:
                    with urllib.request.urlopen(request, timeout=300) as r:
                        status, ctype, payload = r.status, r.headers.get("Content-Type"), r.read()
                except urllib.error.HTTPError as exc:
                    status, ctype, payload = exc.code, exc.headers.get("Content-Type"), exc.read()
                self._answer(status, ctype, payload)

            def _answer(self, status: int, ctype: str | None, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype or "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                try:
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # the caller was killed meanwhile
                    pass

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> GateProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()

    def _open(self) -> bool:
        return self._hold_at is None or self._forwarded < self._hold_at

    @property
    def forwarded(self) -> int:
        with self._cond:
            return self._forwarded

    def _admit(self) -> bool:
        """Wait while holding; False if the request was dropped meanwhile (drop_held)."""
        with self._cond:
            if not self._open():
                generation = self._generation
                self.held += 1
                self._cond.notify_all()
                # One at a time: each admission counts towards the next hold.
                self._cond.wait_for(lambda: self._open() or self._generation != generation)
                self.held -= 1
                self._cond.notify_all()
                if self._generation != generation:
                    return False
            self._forwarded += 1
            return True

    def drop_held(self) -> None:
        """Answer every request held now 503 without forwarding it (its sender is gone)."""
        with self._cond:
            self._generation += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.held == 0, timeout=10)

    def hold_after(self, n: int) -> None:
        """Let ``n`` more POSTs through from now, then hold every further one."""
        with self._cond:
            self._hold_at = self._forwarded + n
            self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self._hold_at = None
            self._cond.notify_all()

    def wait_held(self, timeout_s: float) -> bool:
        """True once a request is being held (its sender is stuck mid-shard)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            return self._cond.wait_for(lambda: self.held > 0, max(0.0, deadline - time.monotonic()))
