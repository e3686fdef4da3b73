"""`airflow dags test` runs, each in a fresh process forked from one that has Airflow loaded.

A `dags test` run cost ~15 CPU-s of fixed work before its first task (py-spy, 2026-12-07: 30 %
imports; 35 % building the in-process execution API's versioned routes, Cadwyn's, on its first
request) and the suite makes ~50 of them. This server pays both once: it imports the CLI and the
DAG's modules, builds the execution API app through Airflow's own in-process entry point, and then
forks one child per run. The child is the run: it takes the request's environment whole, writes its
stdout and stderr to files, and calls Airflow's CLI entry point (``airflow.__main__.main``) with the
request's arguments, so the DAG file is parsed, synced and run as ``airflow dags test`` does, in a
process no other run touched. Its exit status is the command's.

What the parent read at import stays: the settings Airflow reads once per process (its home, the
database, core, logging). ``base_key`` names them; the client (conftest.dags_test) keeps one server
per key, so a run never sees another base's settings. Everything else (connections, variables,
``[aibrix_batch]``, AWS) Airflow and the pipeline read when used, from the child's environment.

Protocol: one JSON request per line on stdin (``argv``, ``env``, ``cwd``, ``stdout``, ``stderr``,
``timeout_s``), one JSON answer per line on stdout (``rc``, ``timed_out``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Mapping

# Settings Airflow reads once per process (at import or at its first use, then cached): a request
# whose values differ needs a server started with them.
_PER_PROCESS_PREFIXES = ("AIRFLOW__CORE__", "AIRFLOW__DATABASE__", "AIRFLOW__LOGGING__", "AIRFLOW__SECRETS__")
_PER_PROCESS_KEYS = ("AIRFLOW_HOME", "AIRFLOW_CONFIG", "PYTHONPATH", "PATH", "TZ")


def base_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of an environment a server fixes when it starts."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if k in _PER_PROCESS_KEYS or k.startswith(_PER_PROCESS_PREFIXES)))


def warm() -> None:
    """Import what every run imports, and build the in-process execution API's routes."""
    import asyncio

    import airflow.__main__  # noqa: F401 - the CLI, its parser and Airflow's settings
    import httpx
    from airflow.cli.commands import dag_command  # noqa: F401 - the `dags test` command
    from airflow.sdk.execution_time.supervisor import in_process_api_server

    import aibrix_operators.operators.pipeline  # noqa: F401 - what dags/batch_inference.py imports

    # The app is built once per process (in_process_api_server is cached); its versioned routes on
    # its first request. One request here, on an event loop that ends with it: the child starts
    # its own transport thread (threads do not survive a fork).
    app = in_process_api_server().app

    async def first_request() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://in-process") as client:
            await client.get("/health")

    asyncio.run(first_request())


def _child(request: dict) -> None:
    """The run itself (never returns)."""
    code = 1
    try:
        os.setpgid(0, 0)  # the run and what it starts: one group, for a timeout's kill
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        devnull = os.open(os.devnull, os.O_RDONLY)  # the protocol's pipe is the parent's
        os.dup2(devnull, 0)
        os.close(devnull)
        sys.argv = ["airflow", *request["argv"]]
        from airflow.__main__ import main

        main()
        code = 0
    except SystemExit as stop:  # as the `airflow` console script exits
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - an uncaught error ends the command with status 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - exiting anyway
                pass
        os._exit(code)


def _wait(pid: int, timeout_s: float) -> tuple[int, bool]:
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status), True
        time.sleep(0.05)


def serve() -> None:
    # The answers get a pipe of their own; fd 1 goes to the server's log, since what Airflow logs
    # while it loads goes to stdout. A child points fd 1 at its run's stdout file.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    warm()
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.close(answers.fileno())
            _child(request)
        rc, timed_out = _wait(pid, request["timeout_s"])
        print(json.dumps({"rc": rc, "timed_out": timed_out}), file=answers, flush=True)


if __name__ == "__main__":
    serve()
