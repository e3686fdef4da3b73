"""Process hygiene of the local server helpers: the whole group stops, files close."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from aibrix_operators.serving.process import ServerProcess, stop_process, stop_process_group

pytestmark = pytest.mark.service


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is not alive: it holds no memory or ports
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _open_fds_to(path) -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                count += 1
        except OSError:
            pass
    return count


def test_stop_kills_children_when_the_leader_already_exited(tmp_path):
    pidfile = tmp_path / "child.pid"
    # The leader starts an "engine" child and exits, as a crashed API server would.
    leader = subprocess.Popen(["bash", "-c", f"sleep 300 & echo $! > {pidfile}; exit 3"],
                              start_new_session=True)
    leader.wait(10)
    child = int(pidfile.read_text())
    assert _alive(child)
    stop_process_group(leader, grace_s=5)
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_child_ignoring_sigterm_is_killed_after_grace(tmp_path):
    script = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "print('up', flush=True); time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    started = time.monotonic()
    stop_process_group(proc, grace_s=0.5)
    assert proc.returncode is not None and time.monotonic() - started < 8
    assert not _alive(proc.pid)


def test_server_process_keeps_no_log_descriptor_and_stops_its_group(tmp_path):
    log = tmp_path / "server.log"
    server = ServerProcess([sys.executable, "-c", "print('hello', flush=True); import time; time.sleep(300)"],
                           dict(os.environ), log, name="sleeper").start()
    assert _open_fds_to(log) == 0  # only the child holds it
    deadline = time.monotonic() + 10
    while "hello" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "hello" in log.read_text()
    assert server.proc is not None
    pid = server.proc.pid
    server.stop(grace_s=2)
    assert not _alive(pid)

    dying = ServerProcess([sys.executable, "-c", "raise SystemExit(7)"], dict(os.environ), log, name="dying")
    dying.start()
    with pytest.raises(RuntimeError, match="dying exited with code 7"):
        dying.wait_healthy("http://127.0.0.1:9/health", timeout_s=20)
    assert _open_fds_to(log) == 0


def test_a_server_that_never_turns_healthy_is_stopped_saying_what_it_answered(tmp_path):
    """A listening server that answers 503 to the health probe: the timeout names the answer (a
    clean-clone run had a vLLM server fail this wait with only its log to go on)."""
    from aibrix_operators.serving.local_vllm import free_port

    port = free_port()
    code = ("import http.server\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n        self.send_response(503); self.end_headers()\n"
            f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    server = ServerProcess([sys.executable, "-c", code], dict(os.environ), tmp_path / "s.log",
                           name="sick").start()
    assert server.proc is not None
    pid = server.proc.pid
    with pytest.raises(TimeoutError, match=rf"sick did not become healthy in 3s \(last probe of "
                                           rf"http://127.0.0.1:{port}/health: HTTP 503\)"):
        server.wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s=3)
    assert not _alive(pid)


def test_stop_process_kills_a_child_that_ignores_sigterm_after_grace():
    script = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "print('up', flush=True); time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    started = time.monotonic()
    stop_process(proc, grace_s=0.5)
    assert proc.returncode == -9 and time.monotonic() - started < 8
    assert not _alive(proc.pid)
    stop_process(proc)  # already reaped: nothing to do, no error


def test_stop_process_ends_a_child_on_sigterm():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    stop_process(proc, grace_s=10)
    assert proc.returncode == -15


def test_a_start_up_failure_names_the_cause_from_above_the_final_traceback(tmp_path):
    # What vLLM writes when its engine core cannot start (the connector's metrics port in use,
    # reproduced 2026-12-07): the cause first, then thirty-odd lines of the API server's traceback
    # that end in "See root cause above". The message must carry the cause, not only that tail.
    script = (
        "import sys\n"
        "print('(EngineCore pid=7) ERROR EngineCore failed to start.')\n"
        "print('OSError: [Errno 98] Address already in use')\n"
        "for i in range(40): print(f'  File \"x.py\", line {i}, in f')\n"
        "print('RuntimeError: Engine core initialization failed. See root cause above.')\n"
        "sys.exit(1)\n"
    )
    proc = ServerProcess([sys.executable, "-c", script], dict(os.environ), tmp_path / "s.log", name="vLLM")
    with pytest.raises(RuntimeError) as failed:
        proc.start().wait_healthy("http://127.0.0.1:9/health", timeout_s=30)
    message = str(failed.value)
    assert "exited with code 1" in message
    cause = message.index("OSError: [Errno 98] Address already in use")
    assert cause < message.index("RuntimeError: Engine core initialization failed")
