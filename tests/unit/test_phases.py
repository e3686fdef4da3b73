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
    first = phases.probe(record, runs=2)
    with record.open("a") as fh:  # what run() appends (it starts a process: not a unit test's)
        fh.write(json.dumps({"phase": "lint", "start": 100.0, "end": 101.0, "rc": 0}) + "\n")
        fh.write(json.dumps({"phase": "tests", "start": 101.0, "end": 161.0, "rc": 1}) + "\n")
    phases.probe(record, runs=1)
    lines = phases.report(record).splitlines()
    assert [line.split()[0] for line in lines[1:3]] == ["lint", "tests"]
    assert lines[2].endswith(" 1")  # the failed phase's exit status
    assert lines[3].split() == ["in", "all", "61s"]
    assert lines[4].startswith("speed probe") and lines[4].count("s,") == 1, lines[4]
    assert f"{first:.2f}s" in lines[4]
    assert sum("probe" in json.loads(x) for x in record.read_text().splitlines()) == 2


def test_the_probe_keeps_its_best_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    times = iter([0.0, 5.0, 10.0, 11.0])  # two runs: 5 s, then 1 s
    monkeypatch.setattr(phases.time, "perf_counter", lambda: next(times))
    monkeypatch.setattr(phases, "_workload", lambda: 0)
    assert phases.probe(tmp_path / "r.jsonl", runs=2) == 1.0
