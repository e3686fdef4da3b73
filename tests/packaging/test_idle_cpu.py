"""tests/idle_cpu.py: the eval model's training beside the parallel pass runs in an idle CPU class.

Where an idle group can be made (root with a cgroup cpu controller: CI and these VMs), a command
run through it lands in a group with ``cpu.idle = 1``, and so does every process it starts in a
session of its own (why a cgroup and not ``nice``); the group is gone after. Where none can be
made, ``--check`` says why and exits 1, and ``--or-plain`` runs the command as usual.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import idle_cpu

pytestmark = pytest.mark.service  # it runs commands through the wrapper

REPO = Path(__file__).resolve().parents[2]
# A child in a new session (as the suite's servers start) prints the cpu cgroup it is in and that
# group's cpu.idle, read while it runs (argv[1]: the cgroup root).
PROBE = """
import subprocess, sys
code = '''
import pathlib, sys
lines = pathlib.Path("/proc/self/cgroup").read_text().splitlines()
group = [l.split(":", 2)[2] for l in lines if l.split(":", 2)[1] in ("cpu", "cpu,cpuacct", "")][0]
print(group, (pathlib.Path(sys.argv[1] + group) / "cpu.idle").read_text().strip())
'''
subprocess.run([sys.executable, "-c", code, sys.argv[1]], start_new_session=True, check=True)
"""


def _wrapper(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.idle_cpu", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_a_command_and_its_new_sessions_run_in_an_idle_group_that_is_removed_after() -> None:
    check = _wrapper("--check")
    try:
        root = idle_cpu.cgroup_root()
    except idle_cpu.IdleClassUnavailable as exc:
        assert check.returncode == 1 and "one after the other" in check.stderr, (exc, check)
        return
    if check.returncode != 0:  # a cpu controller, but no right to make groups in it
        assert "cannot" in check.stderr, check
        return
    ran = _wrapper(sys.executable, "-c", PROBE, str(root))
    assert ran.returncode == 0, ran.stderr
    group, idle = ran.stdout.split()
    assert group.startswith("/aibrix-suite-idle-"), ran.stdout  # not the caller's group
    assert idle == "1", ran.stdout
    assert not (root / group.lstrip("/")).exists()  # removed once the command ended


def test_the_exit_status_is_the_commands() -> None:
    exits_7 = (sys.executable, "-c", "raise SystemExit(7)")
    # --or-plain runs it either way: in an idle group, or as usual where none can be made.
    assert _wrapper("--or-plain", *exits_7).returncode == 7
    if _wrapper("--check").returncode != 0:
        assert _wrapper(*exits_7).returncode == 2  # no idle class: refuses to run, says why
        return
    assert _wrapper(*exits_7).returncode == 7
    missing = _wrapper("/nonexistent/command")
    assert missing.returncode == 127 and "cannot run /nonexistent/command" in missing.stderr, missing
