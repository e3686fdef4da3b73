"""Run a command in an idle CPU class: it gets the CPU that nothing else wants, mostly.

The nightly-eval model's training runs this way beside ``make test``'s parallel pass: it takes the
pass's idle moments rather than competing with its tests. ``nice`` would not do: the suite's
servers start their own sessions, and each session is its own autogroup that competes at nice 0
whatever its parent's nice was. A cgroup with ``cpu.idle = 1`` (the kernel's SCHED_IDLE for a
whole group) holds every process below the command, sessions included.

Not isolation: on this VM's kernel (6.18, EEVDF, cgroup v1) busy processes in an idle group stall
normal ones for seconds at a time (docs/testing.md), so nothing timing-sensitive runs beside it
(the serial pass runs alone).

    python -m tests.idle_cpu --check        # exit 0 if an idle group can be made here, else 1
    python -m tests.idle_cpu CMD [ARG ...]   # run CMD in a new idle group; its exit status
    python -m tests.idle_cpu --or-plain CMD [ARG ...]   # the same, or as usual where none can be made

The training runs the ``--or-plain`` way; a test that needs the model waits on the training's
lock, which leaves that test's core to the training.

Needs write access to the cgroup tree (root on CI and these VMs) and a kernel with ``cpu.idle``
(5.15+), cgroup v1 (``/sys/fs/cgroup/cpu``) or v2. Where that is missing, ``--check`` says why
and ``--or-plain`` runs the command as usual.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")


class IdleClassUnavailable(RuntimeError):
    pass


def cgroup_root() -> Path:
    """Where a new cpu cgroup goes: the v1 cpu hierarchy, or the v2 root with its cpu controller."""
    if (V1_ROOT / "cpu.shares").exists():
        return V1_ROOT
    controllers = V2_ROOT / "cgroup.subtree_control"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return V2_ROOT
    raise IdleClassUnavailable("no cgroup cpu controller at /sys/fs/cgroup/cpu or in /sys/fs/cgroup")


def make_idle_group(name: str) -> Path:
    """A new cgroup with ``cpu.idle = 1``; IdleClassUnavailable (nothing left behind) if not possible."""
    group = cgroup_root() / name
    try:
        group.mkdir()
    except OSError as exc:
        raise IdleClassUnavailable(f"cannot create {group}: {exc.strerror}") from exc
    try:
        (group / "cpu.idle").write_text("1")
    except OSError as exc:
        group.rmdir()
        raise IdleClassUnavailable(f"cannot set {group}/cpu.idle: {exc}") from exc
    return group


def _call(argv: list[str], preexec_fn=None) -> int:
    """Run the command; its exit status."""
    try:
        # close_fds=False: the command inherits what it would without this wrapper, make's
        # jobserver pipe among them (a sub-make that lost it warns and runs -j1).
        return subprocess.call(argv, preexec_fn=preexec_fn, close_fds=False)
    except OSError as exc:  # not found, not executable: say so, as a shell would (127)
        print(f"idle_cpu: cannot run {argv[0]}: {exc.strerror}", file=sys.stderr)
        return 127


def run_idle(argv: list[str]) -> int:
    group = make_idle_group(f"aibrix-suite-idle-{os.getpid()}")
    procs = group / "cgroup.procs"

    def join_group() -> None:  # in the child, before exec: everything it starts stays in the group
        procs.write_text(str(os.getpid()))

    try:
        return _call(argv, join_group)
    finally:
        try:
            group.rmdir()
        except OSError:
            pass  # a process the command left behind still holds it; the kernel keeps it until it ends


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        try:
            os.rmdir(make_idle_group(f"aibrix-suite-idle-check-{os.getpid()}"))
        except IdleClassUnavailable as exc:
            print(f"no idle CPU class here ({exc}): the passes run one after the other", file=sys.stderr)
            return 1
        return 0
    or_plain = argv[:1] == ["--or-plain"]
    command = argv[1:] if or_plain else argv
    if not command or command[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        return run_idle(command)
    except IdleClassUnavailable as exc:
        if not or_plain:
            print(f"idle_cpu: {exc}", file=sys.stderr)
            return 2
        print(f"idle_cpu: {exc}; running it at the usual priority", file=sys.stderr)
        return _call(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
