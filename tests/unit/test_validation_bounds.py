"""Hostile inputs cost bounded memory and a bounded report.

Each case runs ``validate_batch`` (what the validate task runs, on a real file,
writing a real batch.json) in a fresh child process and reads the child's peak
RSS (VmHWM) before and after, so the numbers are the validator's own, not this
test process's. Measured here: newlines 35 → 48 MiB peak, batch.json 872 B;
4 MiB methods 35 → 57 MiB peak, batch.json 17.9 KB, log summary 13 K chars.
Before the fix 20 MB of newlines already took 790 MiB (200 MB: ~7.5 GiB) and
the method file wrote a ~190 MB batch.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.conftest import request_line

pytestmark = pytest.mark.service  # each test measures a child process's memory

MB = 1_000_000
MiB = 1024 * 1024

_CHILD = r"""
import json, sys
from aibrix_operators.batch.job import validate_batch
from aibrix_operators.storage import LocalStorage

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

before = hwm()
report, batch = validate_batch(LocalStorage(), sys.argv[1], sys.argv[2])
print(json.dumps({"before": before, "after": hwm(), "ok": batch is not None,
                  "summary_chars": len(report.summary()), "total": report.error_count}))
"""


def _validate_in_child(input_path: Path, out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(input_path), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_200_mb_of_newlines_costs_bounded_memory(tmp_path):
    path = tmp_path / "newlines.jsonl"
    chunk = b"\n" * (8 * MiB)
    with open(path, "wb") as fh:
        fh.write(request_line("first"))
        left = 200 * MB
        while left:
            n = min(left, len(chunk))
            fh.write(chunk[:n])
            left -= n
        fh.write(request_line("second"))
    out = tmp_path / "out"
    measured = _validate_in_child(path, out)

    assert not measured["ok"] and measured["total"] == 1
    batch = json.loads((out / "batch.json").read_text())
    [error] = batch["errors"]["data"]
    assert error["code"] == "blank_line" and error["line"] == 2
    assert f"{200 * MB} blank lines" in error["message"]
    # A list of 200M line numbers was ~7.5 GiB; the run is now two integers.
    assert measured["after"] - measured["before"] < 32 * MiB, measured
    assert measured["after"] < 200 * MiB, measured
    assert (out / "batch.json").stat().st_size < 4096


def test_4_mib_bad_method_values_give_a_bounded_report(tmp_path):
    path = tmp_path / "methods.jsonl"
    line_bytes = 4 * MiB  # the default max_line_bytes: every line is as long as allowed
    overhead = len(request_line("id-00", method=""))
    n_lines = 45  # ~189 MB, under the default 200 MiB max_file_bytes
    with open(path, "wb") as fh:
        for i in range(n_lines):
            line = request_line(f"id-{i:02d}", method="X" * (line_bytes + 1 - overhead))
            assert len(line) == line_bytes + 1
            fh.write(line)
    out = tmp_path / "out"
    measured = _validate_in_child(path, out)

    assert not measured["ok"] and measured["total"] == n_lines
    batch_size = (out / "batch.json").stat().st_size
    batch = json.loads((out / "batch.json").read_text())
    assert [e["code"] for e in batch["errors"]["data"]] == ["invalid_method"] * n_lines
    assert all(len(e["message"]) < 500 for e in batch["errors"]["data"])
    # 45 echoed 4 MiB values were ~190 MB of batch.json and of log line; now ~300 bytes each.
    assert batch_size < 64 * 1024, batch_size
    assert measured["summary_chars"] < 64 * 1024, measured
    # One line (4 MiB of bytes, then its parsed str) is the most held at a time.
    assert measured["after"] - measured["before"] < 64 * MiB, measured
    assert measured["after"] < 200 * MiB, measured
