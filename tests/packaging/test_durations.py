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
    monkeypatch.setattr(durations, "TESTS", tests_dir)
    monkeypatch.setattr(durations, "STORED", stored)
    monkeypatch.setattr(durations, "RECORDS", records)

    assert durations.update() == {"x/test_measured.py": 42.0, "x/test_kept.py": 5.0}
    assert list(json.loads(stored.read_text())) == ["x/test_measured.py", "x/test_kept.py"]  # longest first


def test_the_recorder_sums_every_phase_of_a_files_tests() -> None:
    recorder = durations.Recorder()
    for nodeid, seconds in (("tests/a.py::t1", 1.5), ("tests/a.py::t1", 0.25), ("tests/b.py::t[x]", 2.0)):
        recorder.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=seconds))
    assert dict(recorder.seconds) == {"a.py": 1.75, "b.py": 2.0}
