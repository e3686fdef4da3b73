"""From start to first request: the batch driver as a podman container of the built image, beside
the same driver CLI started as a local process (the baseline), alternating, median of N each.

    .venv/bin/python bench/driver_container_start.py --runs 5

The clock starts just before the process (``podman run`` or ``python -m ...``) is spawned and
stops when a local stub endpoint receives the first POST of the shard. The image is built first
(``inference_images/build.py batch-driver``, a cache hit after ``make images``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from aiohttp import web

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.images.containers import RUN_FLAGS, build  # noqa: E402
from tests.k8s_double.podman import PODMAN  # noqa: E402

ANSWER = {
    "id": "c", "object": "chat.completion", "created": 0, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}  # fmt: skip


class FirstRequestStub:
    """An OpenAI-compatible stub on 127.0.0.1 that notes when the first POST arrives."""

    def __init__(self) -> None:
        self.first_post: float | None = None
        self.port = 0
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._post)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        ready.set()
        self._loop.run_forever()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def _post(self, request: web.Request) -> web.Response:
        if self.first_post is None:
            self.first_post = time.monotonic()
        await request.read()
        return web.json_response(ANSWER)


def shard(dir_: Path, n: int) -> Path:
    dir_.mkdir(parents=True, exist_ok=True)
    os.chmod(dir_, 0o777)  # the image's uid 65532 writes its results here
    path = dir_ / "shard-00000.jsonl"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    lines = (json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
             for i in range(n))  # fmt: skip
    path.write_text("".join(line + "\n" for line in lines))
    return path


def time_to_first_request(argv: list[str], stub: FirstRequestStub) -> float:
    stub.first_post = None
    started = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 or stub.first_post is None:
        raise SystemExit(f"run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return stub.first_post - started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    image = build("batch-driver")["tag"]
    stub = FirstRequestStub()
    endpoint = f"http://127.0.0.1:{stub.port}"
    times: dict[str, list[float]] = {"container": [], "process": []}
    with tempfile.TemporaryDirectory(prefix="driver-start-") as tmp:
        for i in range(args.runs):
            for mode in ("container", "process"):  # alternating: the machine's drift hits both
                work = Path(tmp) / f"{mode}-{i}"
                path = shard(work, args.requests)
                cli = ["--shard-uri", "SHARD", "--results-prefix", "RESULTS", "--endpoint", endpoint,
                       "--total", str(args.requests)]  # fmt: skip
                if mode == "container":
                    cli[1], cli[3] = "/data/shard-00000.jsonl", "/data/results"
                    argv = [*PODMAN, "run", *RUN_FLAGS, "-v", f"{work}:/data:Z", image, *cli]
                else:
                    cli[1], cli[3] = str(path), str(work / "results")
                    argv = [sys.executable, "-m", "aibrix_operators.driver.cli", *cli]
                times[mode].append(time_to_first_request(argv, stub))
    print(f"# {time.strftime('%Y-%m-%d')} {platform.machine()} {os.cpu_count()} cores, image {image}")
    for mode, values in times.items():
        print(f"{mode:9s} start -> first request: median {statistics.median(values):.3f} s  "
              f"(min {min(values):.3f}, max {max(values):.3f}, n={len(values)})")  # fmt: skip
    ratio = statistics.median(times["container"]) / statistics.median(times["process"])
    print(f"container / process (medians): {ratio:.2f}")


if __name__ == "__main__":
    main()
