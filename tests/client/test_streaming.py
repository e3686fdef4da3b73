"""Results and uploads are streamed: the shipped console script against a stand-in Batch API
in its own process (tests/client/batch_api_stub.py), its peak RSS measured by a parent whose
only child it is. A client that held the 128 MB file whole would grow by at least that much."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from aibrix_operators.client import BatchClient
from tests.client.batch_api_stub import BATCH_ID, KEY

pytestmark = pytest.mark.service

STUB = Path(__file__).with_name("batch_api_stub.py")
CLI = str(Path(sys.executable).with_name("aibrix-batch"))
MB = 1_000_000
# ru_maxrss of the parent's only child: the CLI process, from start to exit.
MEASURE = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True); "
           "sys.stderr.buffer.write(p.stderr); "
           "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")


@pytest.fixture
def stub(request) -> Iterator[str]:
    mb = getattr(request, "param", 128)
    proc = subprocess.Popen([sys.executable, str(STUB), "--output-mb", str(mb)], stdout=subprocess.PIPE,
                            text=True)
    try:
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def run_measured(*args: str) -> tuple[int, int]:
    proc = subprocess.run([sys.executable, "-c", MEASURE, CLI, *args], capture_output=True, text=True,
                          timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    code, rss = proc.stdout.split()
    return int(code), int(rss)


def test_results_stream_to_disk_without_holding_the_file(stub, tmp_path):
    out = tmp_path / "out.jsonl"
    conn = ("--base-url", stub, "--api-key", KEY)
    code, baseline = run_measured("status", BATCH_ID, *conn)  # same imports, a small answer
    assert code == 0
    code, rss = run_measured("results", BATCH_ID, "-o", str(out), *conn)
    assert code == 0
    assert out.stat().st_size == 128 * MB and [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]
    with open(out, "rb") as f:
        first = json.loads(f.readline())
        f.seek(-1000, 2)
        last = json.loads(f.read())
    assert first["custom_id"] == "req-00000000" and last["response"]["status_code"] == 200
    # Whole 128 MB (or a 1 MiB re-chunking buffer per read) would show; a few MB of sockets and
    # page-cache bookkeeping do not.
    assert rss - baseline < 24 * MB, (rss, baseline)


@pytest.mark.parametrize("stub", [32], indirect=True)
def test_client_results_iterate_lines_in_flat_memory(stub):
    client = BatchClient(stub, KEY)
    tracemalloc.start()
    try:
        count = 0
        for line in client.results(BATCH_ID):
            assert line["response"]["status_code"] == 200
            count += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 32 * MB // 1000
    assert peak < 4 * MB, peak  # the SDK's buffers and one chunk, never the 32 MB file


def test_upload_is_streamed_from_disk(stub, tmp_path):
    def write(path: Path, size: int) -> Path:
        body = {"model": "m", "messages": [{"role": "user", "content": "y" * 851}]}
        with open(path, "w") as f:
            for i in range(size // 1000):  # 1000-byte lines, each with its own custom_id
                f.write(json.dumps({"custom_id": f"x-{i:09d}", "method": "POST",
                                    "url": "/v1/chat/completions", "body": body}) + "\n")
        return path

    big = write(tmp_path / "big.jsonl", 128 * MB)
    conn = ("--base-url", stub, "--api-key", KEY)
    # The baseline creates a small batch: the same imports (the local line check's validator),
    # so what is compared is what a big file adds.
    code, baseline = run_measured("create", "--input", str(write(tmp_path / "small.jsonl", 10_000)), *conn)
    assert code == 0
    code, rss = run_measured("create", "--input", str(big), *conn)
    assert code == 0
    assert rss - baseline < 24 * MB, (rss, baseline)
    seen: list[int] = []
    uploaded = BatchClient(stub, KEY).upload(big, on_progress=lambda done, total: seen.append(done))
    assert uploaded.bytes >= big.stat().st_size  # every byte arrived (plus the multipart envelope)
    assert seen[-1] == big.stat().st_size and len(seen) > 100  # read piece by piece, as sent
