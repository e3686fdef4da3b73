"""A clock for ``make test``'s phases: setup, the images, lint, each pass.

    python3 -m tests.phases reset
    python3 -m tests.phases run NAME -- CMD ...   # runs CMD, records NAME's start, end, exit status
    python3 -m tests.phases report
    python3 -m tests.phases probe                 # times two fixed one-core workloads, recorded

CI keeps only the tail of a run's output, and the suite's time budget (issue 37) is judged on CI's
machine, whose caches (pip's, podman's layers) may be cold where this one's are warm. ``run``
prints the table when its command fails, and ``make test`` prints it last, so the tail says where
the time went either way. Standard library only: it runs before the virtualenvs exist.

The probe: this VM ran the same tree's serial pass in 174 s one day and 295 s another (clean clones,
docs/testing.md), so a suite's time says little without the machine's speed beside it. ``make test``
times a fixed single-threaded workload at its start and at its end, when nothing else of the suite
runs, and the report prints both: runs compare by their times over their probes.

Two workloads, since one did not say enough: pure Python (``_workload``), and system calls
(``_io_workload``: small messages over a socket pair, what the driver, the Airflow components and the
tests' HTTP traffic spend much of their CPU on). On 2026-12-08 the Python probe read 0.48-0.88 s
within an hour while the driver alone against the stub (``bench/driver_stub.py``) cost 370 us of
CPU a request against 166 us on 2026-11-29 for the same code, and the same tree's 1M-request bench
took 408 s against 127 s on 2026-12-06: the VM's slowdowns are not uniform across kinds of work.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

RECORD = Path(__file__).resolve().parents[1] / ".work" / "phases.jsonl"


def reset(record: Path = RECORD) -> None:
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text("")


def run(name: str, cmd: list[str], record: Path = RECORD) -> int:
    """Run ``cmd``; append ``{"phase", "start", "end", "rc"}`` to ``record``; return its status."""
    start = time.time()
    rc = subprocess.call(cmd)
    record.parent.mkdir(parents=True, exist_ok=True)
    with record.open("a") as fh:
        fh.write(json.dumps({"phase": name, "start": start, "end": time.time(), "rc": rc}) + "\n")
    if rc != 0:
        print(f"phase {name!r} failed (exit {rc}):")
        print(report(record))
    return rc


def _workload() -> int:
    """Fixed pure-Python work (integer arithmetic, a dict, string formatting): ~0.5 s on this VM, idle."""
    seen: dict[int, str] = {}
    acc = 0
    for i in range(600_000):
        acc = (acc * 31 + i) % 1_000_003
        seen[acc & 0xFFFF] = f"{i:x}"
    return acc + len(seen)


def _io_workload() -> int:
    """Fixed system-call work: 20,000 round trips of 64 bytes over a socket pair (~0.2 s here, idle)."""
    a, b = socket.socketpair()
    message = b"x" * 64
    got = 0
    try:
        for _ in range(20_000):
            a.sendall(message)
            got += len(b.recv(64))
            b.sendall(message)
            got += len(a.recv(64))
    finally:
        a.close()
        b.close()
    return got


def _best(workload: Callable[[], int], runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        workload()
        best = min(best, time.perf_counter() - start)
    return best


def probe(record: Path = RECORD, runs: int = 3) -> tuple[float, float]:
    """Each workload's best wall time of ``runs`` (the best: a stray process must not count):
    (Python, system calls), recorded."""
    python_s, io_s = _best(_workload, runs), _best(_io_workload, runs)
    record.parent.mkdir(parents=True, exist_ok=True)
    with record.open("a") as fh:
        fh.write(json.dumps({"probe": python_s, "io_probe": io_s, "at": time.time()}) + "\n")
    return python_s, io_s


def report(record: Path = RECORD) -> str:
    try:
        phases = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return "no phases recorded"
    probes = [(p["probe"], p.get("io_probe")) for p in phases if "probe" in p]
    phases = [p for p in phases if "phase" in p]
    if not phases:
        return "no phases recorded"
    first = min(p["start"] for p in phases)
    lines = [f"{'phase':<22} {'from':>7} {'took':>7}  exit"]
    for p in phases:
        took = p["end"] - p["start"]
        lines.append(f"{p['phase']:<22} {p['start'] - first:>6.0f}s {took:>6.0f}s  {p['rc']}")
    lines.append(f"{'in all':<22} {'':>7} {max(p['end'] for p in phases) - first:>6.0f}s")
    if probes:
        lines.append("speed probe (one core, fixed work; lower is faster): Python "
                     + ", ".join(f"{py:.2f}s" for py, _ in probes) + "; system calls "
                     + ", ".join("-" if io is None else f"{io:.2f}s" for _, io in probes))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["reset"]:
        reset()
        return 0
    if argv[:1] == ["probe"]:
        python_s, io_s = probe()
        print(f"speed probe: Python {python_s:.2f}s, system calls {io_s:.2f}s")
        return 0
    if argv[:1] == ["report"]:
        print("make test's phases (python3 -m tests.phases report):")
        print(report())
        return 0
    if argv[:1] == ["run"] and len(argv) > 3 and argv[2] == "--":
        return run(argv[1], argv[3:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
