"""A zero-latency vLLM stand-in for router benchmarks: raw asyncio HTTP/1.1, keep-alive.

Like ``_stub_server.py`` (which answers only POSTs), plus what the router asks of an
instance: ``GET /health`` (200) and ``GET /metrics`` (vLLM's load gauges, all zero).

    python bench/_pd_stub.py --port 0 --cpu 1     # prints "PORT <n>" when listening
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

BODY = json.dumps(
    {
        "id": "cmpl-stub",
        "object": "text_completion",
        "created": 1700000000,
        "model": "tiny-llama",
        "choices": [{"index": 0, "text": " a stub answer", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 120, "completion_tokens": 10, "total_tokens": 130},
    },
    separators=(",", ":"),
).encode()
METRICS = (
    b'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 0.0\n'
    b'vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 0.0\n'
    b'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.0\n'
)


def _response(body: bytes, ctype: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
        + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip


POST = _response(BODY, b"application/json")
HEALTH = _response(b"", b"text/plain")
METRICS_RESPONSE = _response(METRICS, b"text/plain")
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"


class PDStubProtocol(asyncio.Protocol):
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
                out.append(POST)
            elif head.startswith(b"GET /health"):
                out.append(HEALTH)
            elif head.startswith(b"GET /metrics"):
                out.append(METRICS_RESPONSE)
            else:
                out.append(NOT_FOUND)
            buf = buf[total:]
        self.buf = buf
        if out:
            self.transport.write(b"".join(out))  # type: ignore[attr-defined]


async def serve_forever(port: int, count: int) -> None:
    loop = asyncio.get_running_loop()
    ports = []
    for _ in range(count):
        server = await loop.create_server(PDStubProtocol, "127.0.0.1", port, backlog=4096)
        ports.append(server.sockets[0].getsockname()[1])
    sys.stdout.write("PORT " + " ".join(map(str, ports)) + "\n")
    sys.stdout.flush()
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--count", type=int, default=1, help="listen on this many ports (one stub each)")
    p.add_argument("--cpu", type=int, default=None)
    args = p.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    try:
        import uvloop

        uvloop.run(serve_forever(args.port, args.count))
    except ImportError:
        asyncio.run(serve_forever(args.port, args.count))
    return 0


if __name__ == "__main__":
    sys.exit(main())
