"""A zero-latency OpenAI-compatible stub: raw asyncio HTTP/1.1 with keep-alive.

Every POST gets the same ``chat.completion`` JSON (with ``usage``) at once, so a
client measured against it measures itself. No framework, no JSON parsing of
requests: the server only frames requests by ``Content-Length``. With ``--metrics-page``,
``GET /metrics`` answers that file (a page captured from a real vLLM server, for shared
mode's controller); every other GET is a 404.

    python bench/_stub_server.py --port 0 --cpu 1     # prints "PORT <n>" when listening
    python bench/_stub_server.py --ceiling PORT       # a trivial raw client: the stub's ceiling
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

BODY = json.dumps(
    {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "tiny-llama",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "This is a stub answer of a few tokens."},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 120, "completion_tokens": 10, "total_tokens": 130},
    },
    separators=(",", ":"),
).encode()
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
    + str(len(BODY)).encode()
    + b"\r\nx-request-id: stub\r\n\r\n"
    + BODY
)
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
METRICS: list[bytes] = [NOT_FOUND]  # the GET /metrics answer; set by main()


def metrics_response(page: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: "
            + str(len(page)).encode() + b"\r\n\r\n" + page)


class StubProtocol(asyncio.Protocol):
    __slots__ = ("transport", "buf")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        out = []
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = buf[:end]
            length = 0
            i = head.lower().find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                length = int(head[i + 17 : j if j >= 0 else len(head)])
            total = end + 4 + length
            if len(buf) < total:
                break
            if head.startswith(b"POST"):
                out.append(RESPONSE)
            else:
                out.append(METRICS[0] if head.startswith(b"GET /metrics ") else NOT_FOUND)
            buf = buf[total:]
        self.buf = buf
        if out:
            self.transport.write(b"".join(out))  # type: ignore[attr-defined]


def pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        cpus = os.sched_getaffinity(0)
        if cpu in cpus or not cpus:
            os.sched_setaffinity(0, {cpu})


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def serve(port: int, host: str = "127.0.0.1") -> None:
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    server = loop.run_until_complete(loop.create_server(StubProtocol, host, port, backlog=4096))
    actual = server.sockets[0].getsockname()[1]
    sys.stdout.write(f"PORT {actual}\n")
    sys.stdout.flush()
    try:
        loop.run_forever()
    finally:
        server.close()


async def _ceiling(port: int, requests: int, connections: int) -> float:
    """Requests/s of a minimal keep-alive client: one request in flight per connection."""
    payload = b'{"model":"tiny-llama","messages":[{"role":"user","content":"hi"}]}'
    req = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: "
        + str(len(payload)).encode()
        + b"\r\n\r\n"
        + payload
    )
    resp_len = len(RESPONSE)
    left = [requests]

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while left[0] > 0:
            left[0] -= 1
            writer.write(req)
            await reader.readexactly(resp_len)
        writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(connections)))
    return requests / (time.perf_counter() - t0)


def ceiling(port: int, requests: int = 20_000, connections: int = 64) -> float:
    loop = _new_loop()
    try:
        return loop.run_until_complete(_ceiling(port, requests, connections))
    finally:
        loop.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--cpu", type=int, default=None, help="pin the server to this CPU")
    p.add_argument(
        "--ceiling",
        type=int,
        default=None,
        metavar="PORT",
        help="instead of serving, measure a stub on PORT with a trivial client",
    )
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--metrics-page", default=None, help="answer GET /metrics with this file")
    args = p.parse_args(argv)
    pin(args.cpu)
    if args.metrics_page:
        with open(args.metrics_page, "rb") as fh:
            METRICS[0] = metrics_response(fh.read())
    if args.ceiling is not None:
        print(f"{ceiling(args.ceiling, args.requests, args.connections):.1f}")
        return 0
    serve(args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
