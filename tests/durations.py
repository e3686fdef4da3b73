"""Each test file's duration: recorded by every run, stored in the repository, used to balance.

pytest-xdist's ``--dist loadfile`` hands whole files to whichever worker is free, in collection
order. Longest first (a greedy longest-processing-time schedule) keeps one long file from running
alone at the end while the other worker idles, so the collection is ordered by each file's stored
duration (``tests/durations.json``), longest first. A file with no stored duration (a new one)
goes first: it may be long, and a short file started early costs little.

Every pytest run writes what its files took (setup, call and teardown of each test, so module
fixtures count; the xdist controller, which sees every worker's reports) to
``.work/test-durations/main-<pid>.json``; ``make durations`` folds the last
``make test``'s records into ``tests/durations.json`` (``python -m tests.durations update``), which
is committed. Only the order depends on it: a stale entry costs balance, never a test.

Beside the sums, each run writes a timeline (``timeline-<pid>.json``: per file, the worker that ran
it, its first start and last stop): ``python -m tests.durations timeline`` prints it, which shows
where a pass waited on one long file while the other worker had nothing left. And each test's
phases (``tests-<pid>.json``): ``python -m tests.durations slowest [N]`` prints the N longest test
phases of the last run across every pass, where pytest's ``--durations`` shows each pass's few.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
STORED = TESTS / "durations.json"
RECORDS = TESTS.parent / ".work" / "test-durations"


def file_of(nodeid: str) -> str:
    """``tests/x/test_y.py::test_z[a]`` or ``x/test_y.py::...`` -> ``x/test_y.py`` (relative to tests/)."""
    path = nodeid.split("::", 1)[0]
    return path.removeprefix("tests/")


class Recorder:
    """A pytest plugin: sums each file's test phases in this process and writes them at the end."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.spans: dict[str, list] = {}  # file -> [worker, first start, last stop]
        self.phases: list[tuple[str, str, float]] = []  # (nodeid, setup|call|teardown, seconds)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        name = file_of(report.nodeid)
        self.seconds[name] += report.duration
        self.phases.append((report.nodeid, report.when, round(report.duration, 2)))
        node = getattr(report, "node", None)  # xdist: the worker that ran it
        worker = getattr(getattr(node, "gateway", None), "id", "main")
        span = self.spans.setdefault(name, [worker, report.start, report.stop])
        span[1], span[2] = min(span[1], report.start), max(span[2], report.stop)

    def write(self, worker: str) -> None:
        if not self.seconds:
            return
        RECORDS.mkdir(parents=True, exist_ok=True)
        out = RECORDS / f"{worker}-{os.getpid()}.json"
        out.write_text(json.dumps({k: round(v, 1) for k, v in sorted(self.seconds.items())}, indent=1))
        spans = sorted(([name, *span] for name, span in self.spans.items()), key=lambda s: s[2])
        (RECORDS / f"timeline-{os.getpid()}.json").write_text(json.dumps(spans))
        (RECORDS / f"tests-{os.getpid()}.json").write_text(json.dumps(self.phases))


def stored() -> dict[str, float]:
    try:
        return json.loads(STORED.read_text())
    except FileNotFoundError:
        return {}


def order(items: list[pytest.Item], known: dict[str, float] | None = None) -> None:
    """Sort ``items`` in place: files without a stored duration first, then longest first.

    Stable, so the tests within a file keep pytest's order.
    """
    known = stored() if known is None else known

    def key(item: pytest.Item) -> tuple[bool, float]:
        seconds = known.get(file_of(item.nodeid))
        return (seconds is not None, -(seconds or 0.0))

    items.sort(key=key)


def reset() -> None:
    """Before a ``make test``: forget the records of an earlier run."""
    for old in RECORDS.glob("*.json") if RECORDS.exists() else ():
        old.unlink()


def update() -> dict[str, float]:
    """Fold the last run's records into ``tests/durations.json``; files that no longer exist drop out."""
    merged = stored()
    recorded: defaultdict[str, float] = defaultdict(float)
    for path in sorted(RECORDS.glob("main-*.json")) if RECORDS.exists() else ():
        for name, seconds in json.loads(path.read_text()).items():
            recorded[name] += seconds  # a file in two passes (none today) counts both
    if not recorded:
        raise SystemExit(f"no durations recorded under {RECORDS}: run `make test` first")
    merged.update(recorded)
    merged = {name: round(s, 1) for name, s in merged.items() if (TESTS / name).exists()}
    longest_first = dict(sorted(merged.items(), key=lambda kv: (-kv[1], kv[0])))
    STORED.write_text(json.dumps(longest_first, indent=1) + "\n")
    return merged


def timeline() -> list[str]:
    """The last run's files in the order they started: pass start offset, worker, span, file."""
    lines = []
    for path in sorted(RECORDS.glob("timeline-*.json"), key=lambda p: p.stat().st_mtime):
        spans = json.loads(path.read_text())
        t0 = min(s[2] for s in spans)
        lines.append(f"-- {path.name}: {max(s[3] for s in spans) - t0:.0f} s")
        lines += [f"{start - t0:7.0f} {stop - t0:7.0f}  {worker:5} {name}"
                  for name, worker, start, stop in spans]
    return lines


def slowest(count: int = 40) -> list[str]:
    """The last run's ``count`` longest test phases, every pass together: seconds, phase, test."""
    phases = [phase for path in (RECORDS.glob("tests-*.json") if RECORDS.exists() else ())
              for phase in json.loads(path.read_text())]
    phases.sort(key=lambda p: -p[2])
    return [f"{seconds:8.1f}  {when:8} {nodeid}" for nodeid, when, seconds in phases[:count]]


if __name__ == "__main__":
    if sys.argv[1:] == ["reset"]:
        reset()
    elif sys.argv[1:] == ["update"]:
        done = update()
        print(f"{STORED.relative_to(TESTS.parent)}: {len(done)} files, {sum(done.values()):.0f} s in all")
    elif sys.argv[1:] == ["timeline"]:
        print("\n".join(timeline()))
    elif sys.argv[1:2] == ["slowest"] and len(sys.argv) <= 3:
        print("\n".join(slowest(*(int(n) for n in sys.argv[2:]))))
    else:
        raise SystemExit("usage: python -m tests.durations reset|update|timeline|slowest [N]")
