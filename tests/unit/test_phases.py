"""tests/phases.py: the phase table and the speed probe's line in it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import phases

pytestmark = pytest.mark.unit


def test_report_lists_phases_and_the_probes_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "phases.jsonl"
    phases.reset(record)
    monkeypatch.setattr(phases, "_workload", lambda: 0)
    monkeypatch.setattr(phases, "_io_workload", lambda: 0)
    first, first_io = phases.probe(record, runs=2)
    with record.open("a") as fh:  # what run() appends (it starts a process: not a unit test's)
        fh.write(json.dumps({"phase": "lint", "start": 100.0, "end": 101.0, "rc": 0}) + "\n")
        fh.write(json.dumps({"phase": "tests", "start": 101.0, "end": 161.0, "rc": 1}) + "\n")
    phases.probe(record, runs=1)
    lines = phases.report(record).splitlines()
    assert [line.split()[0] for line in lines[1:3]] == ["lint", "tests"]
    assert lines[2].endswith(" 1")  # the failed phase's exit status
    assert lines[3].split() == ["in", "all", "61s"]
    assert lines[4].startswith("speed probe") and lines[4].count("s,") == 2, lines[4]
    python_part, io_part = lines[4].split("; system calls")
    assert f"{first:.2f}s" in python_part and f"{first_io:.2f}s" in io_part
    recorded = [json.loads(x) for x in record.read_text().splitlines()]
    assert sum("probe" in r and "io_probe" in r for r in recorded) == 2


def test_a_record_from_before_the_io_probe_still_reports(tmp_path: Path) -> None:
    record = tmp_path / "phases.jsonl"
    record.write_text(json.dumps({"probe": 0.7, "at": 1.0}) + "\n"
                      + json.dumps({"phase": "lint", "start": 1.0, "end": 2.0, "rc": 0}) + "\n")
    assert phases.report(record).splitlines()[-1].endswith("Python 0.70s; system calls -")


def test_the_io_workload_moves_every_byte() -> None:
    assert phases._io_workload() == 20_000 * 2 * 64


def test_the_probe_keeps_its_best_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    times = iter([0.0, 5.0, 10.0, 11.0, 20.0, 23.0, 30.0, 32.0])  # Python: 5 s, 1 s; calls: 3 s, 2 s
    monkeypatch.setattr(phases.time, "perf_counter", lambda: next(times))
    monkeypatch.setattr(phases, "_workload", lambda: 0)
    monkeypatch.setattr(phases, "_io_workload", lambda: 0)
    assert phases.probe(tmp_path / "r.jsonl", runs=2) == (1.0, 2.0)
