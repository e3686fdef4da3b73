"""Smoke tests: each bench script's main path at tiny sizes, so the scripts don't rot.

They check that the scripts run end to end and print their tables, not the
figures (this machine is shared; the full-size runs are for a person).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_generated_batch_is_valid_and_reused(tmp_path: Path) -> None:
    vs = _load("validate_split")
    path = vs.generate(tmp_path / "b.jsonl", 300, line_bytes=400)
    lines = path.read_bytes().splitlines()
    assert len(lines) == 300
    ids = [json.loads(line)["custom_id"] for line in lines]
    assert len(set(ids)) == 300
    assert 200 < sum(map(len, lines)) / 300 < 600
    mtime = path.stat().st_mtime_ns
    assert vs.generate(tmp_path / "b.jsonl", 300, line_bytes=400).stat().st_mtime_ns == mtime

    result = vs.run_validate_split(str(path), str(tmp_path / "out"), 100)
    assert result["requests"] == 300 and result["shards"] == 3
    assert result["bytes"] == path.stat().st_size and result["peak_rss_kib"] > 0


def test_validate_split_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    vs = _load("validate_split")
    rc = vs.main(["--lines", "400", "--rss-lines", "100", "--shard-requests", "150",
                  "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc in (0, 1)  # the verdict depends on the machine, not on the code path
    for needle in ("baseline: wc -l", "baseline: python line loop", "validate + split",
                   "peak RSS", "3 shards of 150 requests"):
        assert needle in out
    assert not (tmp_path / "split-out").exists()


def test_driver_stub_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ds = _load("driver_stub")
    rc = ds.main(["--requests", "300", "--concurrency", "4,16", "--no-pin",
                  "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc in (0, 1)
    for needle in ("baseline: raw client (ceiling)", "run_shard, concurrency 4",
                   "run_shard, concurrency 16", "target >= 2000"):
        assert needle in out


def test_stub_answers_keep_alive_and_pipelined_requests() -> None:
    ds = _load("driver_stub")
    stub_mod = sys.modules["_stub_server"]
    import socket

    with ds.StubProcess(cpu=None) as stub:
        body = b'{"model":"m","messages":[]}'
        req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-length: "
               + str(len(body)).encode() + b"\r\n\r\n" + body)
        with socket.create_connection(("127.0.0.1", stub.port), timeout=5) as sock:
            sock.sendall(req * 3)  # pipelined, one connection
            want = len(stub_mod.RESPONSE) * 3
            got = b""
            while len(got) < want:
                chunk = sock.recv(65536)
                assert chunk
                got += chunk
        assert got == stub_mod.RESPONSE * 3
        answer = json.loads(stub_mod.BODY)
        assert answer["object"] == "chat.completion" and answer["usage"]["total_tokens"] == 130
        assert stub_mod.ceiling(stub.port, requests=200, connections=4) > 0
