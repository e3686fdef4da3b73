"""The suite's balance: files ordered by stored durations, the store refreshed from a run's records."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tests import durations


def _items(*nodeids: str) -> list:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_unknown_files_first_then_longest_first_and_each_file_keeps_its_order() -> None:
    items = _items("tests/a.py::t1", "tests/b.py::t1", "tests/a.py::t2", "tests/new.py::t1",
                   "tests/c.py::t1", "tests/b.py::t2")
    durations.order(items, {"a.py": 10.0, "b.py": 300.0, "c.py": 60.0})
    assert [i.nodeid for i in items] == [
        "tests/new.py::t1",  # never measured: may be long, starts first
        "tests/b.py::t1", "tests/b.py::t2", "tests/c.py::t1", "tests/a.py::t1", "tests/a.py::t2",
    ]


def test_a_runs_records_fold_into_the_store_and_deleted_files_drop_out(tmp_path, monkeypatch) -> None:
    tests_dir, records = tmp_path / "tests", tmp_path / "records"
    (tests_dir / "x").mkdir(parents=True)
    records.mkdir()
    for name in ("x/test_kept.py", "x/test_measured.py"):
        (tests_dir / name).write_text("")
    stored = tests_dir / "durations.json"
    stored.write_text(json.dumps({"x/test_kept.py": 5.0, "x/test_gone.py": 99.0, "x/test_measured.py": 1.0}))
    (records / "main-1.json").write_text(json.dumps({"x/test_measured.py": 42.04}))
    (records / "timeline-1.json").write_text(json.dumps([["x/test_measured.py", "gw0", 0.0, 42.0]]))
    monkeypatch.setattr(durations, "TESTS", tests_dir)
    monkeypatch.setattr(durations, "STORED", stored)
    monkeypatch.setattr(durations, "RECORDS", records)

    assert durations.update() == {"x/test_measured.py": 42.0, "x/test_kept.py": 5.0}
    assert list(json.loads(stored.read_text())) == ["x/test_measured.py", "x/test_kept.py"]  # longest first


def test_the_recorder_sums_every_phase_of_a_files_tests_and_keeps_its_span() -> None:
    recorder = durations.Recorder()
    gw1 = SimpleNamespace(gateway=SimpleNamespace(id="gw1"))
    for nodeid, when, start, seconds in (("tests/a.py::t1", "setup", 100.0, 1.5),
                                         ("tests/a.py::t1", "call", 101.5, 0.25),
                                         ("tests/b.py::t[x]", "call", 90.0, 2.0)):
        recorder.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, when=when, duration=seconds,
                                                          node=gw1, start=start, stop=start + seconds))
    assert dict(recorder.seconds) == {"a.py": 1.75, "b.py": 2.0}
    assert recorder.spans == {"a.py": ["gw1", 100.0, 101.75], "b.py": ["gw1", 90.0, 92.0]}
    assert recorder.phases == [("tests/a.py::t1", "setup", 1.5), ("tests/a.py::t1", "call", 0.25),
                               ("tests/b.py::t[x]", "call", 2.0)]


def test_slowest_lists_the_longest_phases_of_every_pass(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(durations, "RECORDS", tmp_path)
    (tmp_path / "tests-1.json").write_text(json.dumps([["a.py::t1", "setup", 3.0],
                                                       ["a.py::t1", "call", 9.5]]))
    (tmp_path / "tests-2.json").write_text(json.dumps([["k.py::t2", "call", 5.25]]))
    assert [line.split() for line in durations.slowest(2)] == [["9.5", "call", "a.py::t1"],
                                                             ["5.2", "call", "k.py::t2"]]


def test_the_timeline_lists_files_by_start_from_the_pass_start(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(durations, "RECORDS", tmp_path)
    (tmp_path / "timeline-7.json").write_text(json.dumps(
        [["b.py", "gw1", 1000.0, 1010.0], ["a.py", "gw0", 1004.0, 1030.0]]))
    lines = durations.timeline()
    assert lines[0] == "-- timeline-7.json: 30 s"
    assert [line.split() for line in lines[1:]] == [["0", "10", "gw1", "b.py"], ["4", "30", "gw0", "a.py"]]
