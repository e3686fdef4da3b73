"""A local server process: its own process group, its log file, a health wait, a clean stop.

Shared by ``serving/local_vllm.py`` (``make run``, end-to-end tests, benches) and
``kvcache/launch.py`` (connector tests and benches). vLLM's API server spawns an
engine process, and the leader can exit (or crash) while that child keeps running
and holding memory and ports, so a stop always signals the whole group and waits
until the group is empty — never only the leader.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

# How long a vLLM server may take to answer /health before it is stopped as hung. A server that
# dies is noticed at once (wait_healthy polls the process), so this bounds only a hang. A quiet
# 2-core machine starts the tiny model in ~75 s; beside a busy Airflow stack and other servers
# starts took over 240 s (the old bound) in clean-clone runs of make test (2026-12-03: the
# engine core's own init began 150 s after the API server's first line).
VLLM_STARTUP_TIMEOUT_S = 600.0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we cannot signal still exists
        return True
    return True


def stop_process_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM every process of the group ``proc`` leads (started with ``start_new_session``),
    SIGKILL what is left after ``grace_s``; return once the group is empty and the leader reaped.

    Works when the leader has already exited: its children are still signalled.
    """
    pgid = proc.pid
    proc.poll()  # reap an exited leader, so a zombie does not count as a live member
    if not _group_alive(pgid):
        return
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        limit = deadline if sig == signal.SIGTERM else time.monotonic() + 10
        while time.monotonic() < limit:
            proc.poll()
            if not _group_alive(pgid):
                proc.wait()
                return
            time.sleep(0.05)
    proc.wait()


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0, kill_wait_s: float = 30.0) -> None:
    """SIGTERM ``proc`` alone (a child that spawns none: a router, a stub server), SIGKILL it after
    ``grace_s``; return once it is reaped, or ``kill_wait_s`` after the SIGKILL.

    A killed process still needs a core to exit; on a starved core that can take a while, and
    waiting longer would change nothing the caller can act on. A server that spawns children
    is started in its own session and stopped with :func:`stop_process_group`.
    """
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.wait(timeout=kill_wait_s)
        except subprocess.TimeoutExpired:
            pass


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


_RAISED = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:[\w.]+\.)?\w*(?:Error|Exception|Exit)\b.*?:\s.+")


def raised(path: Path, most: int = 8) -> list[str]:
    """The distinct exception lines in a log (``OSError: [Errno 98] ...``), first seen first.

    A vLLM server that fails to start ends its log with the API server's traceback ("Engine core
    initialization failed. See root cause above."); the cause is the engine core's exception,
    further up. A CI run (2026-12-07) printed only the tail, and the cause was lost with the log.
    """
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    seen: list[str] = []
    for line in lines:
        line = line.strip()
        if _RAISED.match(line) and line not in seen:
            seen.append(line)
    return seen[:most]


def _startup_failure(path: Path) -> str:
    found = raised(path)
    causes = "".join(f"\n  {line}" for line in found)
    return (f"exceptions in the log, first first:{causes}\n" if found else "") + tail(path)


class ServerProcess:
    """``cmd`` in a new session, output appended to ``log_path``; use ``stop`` (or ``with``)."""

    def __init__(
        self, cmd: Sequence[str], env: Mapping[str, str], log_path: Path, name: str = "server",
        append_log: bool = True,
    ) -> None:
        self.append_log = append_log
        self.cmd = list(cmd)
        self.env = dict(env)
        self.log_path = Path(log_path)
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # The child gets its own copy of the descriptor; ours is closed at once.
        with open(self.log_path, "ab" if self.append_log else "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        return self

    def wait_healthy(self, url: str, timeout_s: float) -> None:
        """Poll ``url`` until it answers 200; stop everything and raise if the process dies or
        the time runs out."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise RuntimeError(f"{self.name} exited with code {code} during startup; see "
                                   f"{self.log_path}:\n{_startup_failure(self.log_path)}")
            last = probe(url)
            if last is None:
                return
            time.sleep(0.5)
        self.stop()
        # The last answer says which way it failed (refused, a hang, a status), which the server's
        # log cannot: a clean-clone run (2026-12-05) had an embeddings server log "startup
        # complete" and then fail this wait for 9 minutes, with nothing else to go on.
        raise TimeoutError(f"{self.name} did not become healthy in {timeout_s:.0f}s (last probe of {url}: "
                           f"{last}); see {self.log_path}:\n{_startup_failure(self.log_path)}")

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, grace_s)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# Health probes go to the server directly, never through a proxy an environment names.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def probe(url: str, timeout_s: float = 2.0) -> str | None:
    """None when ``url`` answers 200; else what it did instead (a status, or the error)."""
    try:
        with _DIRECT.open(url, timeout=timeout_s) as resp:
            return None if resp.status == 200 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    return probe(url, timeout_s) is None
