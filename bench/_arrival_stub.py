"""An OpenAI-compatible stub that answers each POST after a fixed delay and records when
requests arrive, so a bench can tell when the last new request was sent to it.

    python bench/_arrival_stub.py --delay 1.0      # prints "PORT <n>" when listening

``GET /stats`` answers ``{"requests": N, "first_at": t, "last_at": t}`` (wall-clock
``time.time()`` of the first and latest POST to arrive); ``POST /reset`` zeroes them.
Raw asyncio HTTP/1.1 with keep-alive, no framework: the stub costs next to nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from _stub_server import RESPONSE  # the same chat.completion body as the zero-latency stub


class Arrivals:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.requests = 0
        self.first_at: float | None = None
        self.last_at: float | None = None

    def record(self) -> None:
        now = time.time()
        self.requests += 1
        self.last_at = now
        if self.first_at is None:
            self.first_at = now

    def as_json(self) -> bytes:
        return json.dumps({"requests": self.requests, "first_at": self.first_at,
                           "last_at": self.last_at}).encode()


def _plain(status: str, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
            "\r\n\r\n").encode() + body


class DelayProtocol(asyncio.Protocol):
    def __init__(self, arrivals: Arrivals, delay_s: float) -> None:
        self.arrivals = arrivals
        self.delay_s = delay_s
        self.buf = b""
        self.next_send = 0.0  # responses leave in request order on a keep-alive connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            i = head.lower().find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                length = int(head[i + 17 : j if j >= 0 else len(head)])
            total = end + 4 + length
            if len(self.buf) < total:
                return
            self.buf = self.buf[total:]
            self._answer(head)

    def _answer(self, head: bytes) -> None:
        loop = asyncio.get_running_loop()
        if head.startswith(b"GET /stats"):
            self.transport.write(_plain("200 OK", self.arrivals.as_json()))  # type: ignore[attr-defined]
        elif head.startswith(b"POST /reset"):
            self.arrivals.reset()
            self.transport.write(_plain("200 OK", b"{}"))  # type: ignore[attr-defined]
        elif head.startswith(b"POST"):
            self.arrivals.record()
            at = max(loop.time() + self.delay_s, self.next_send)
            self.next_send = at
            loop.call_at(at, self._send, RESPONSE)
        else:
            self.transport.write(_plain("404 Not Found", b"{}"))  # type: ignore[attr-defined]

    def _send(self, data: bytes) -> None:
        if not self.transport.is_closing():  # type: ignore[attr-defined]
            self.transport.write(data)  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--delay", type=float, default=1.0, help="seconds before each answer")
    args = p.parse_args(argv)
    loop = asyncio.new_event_loop()
    arrivals = Arrivals()
    server = loop.run_until_complete(loop.create_server(
        lambda: DelayProtocol(arrivals, args.delay), "127.0.0.1", args.port, backlog=4096))
    sys.stdout.write(f"PORT {server.sockets[0].getsockname()[1]}\n")
    sys.stdout.flush()
    try:
        loop.run_forever()
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
