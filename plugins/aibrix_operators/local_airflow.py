"""Run this checkout's Airflow locally as separate components (api-server, scheduler,
dag-processor, triggerer) and drive it over its REST API.

Used by the REST end-to-end test and by ``bench/e2e_vs_run_batch.py``; a production
deployment runs the same components from its own manifests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aibrix_operators.serving.local_vllm import free_port, stop_process_group

BIN = Path(sys.executable).parent


def wait_until(
    check: Callable[[], bool], timeout_s: float, what: str,
    proc: subprocess.Popen | None = None, log: Path | None = None,
) -> None:
    """Poll ``check`` until it returns true; fail early if ``proc`` dies (with its log's tail)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{tail}")
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{what} not ready after {timeout_s}s")


@dataclass
class AirflowDeployment:
    """api-server + scheduler + dag-processor + triggerer, as separate processes."""

    env: dict[str, str]
    api_url: str
    procs: list[subprocess.Popen]
    home: Path

    def admin_password(self) -> str:
        path = self.home / "simple_auth_manager_passwords.json.generated"
        return json.loads(path.read_text())["admin"]

    def token(self) -> str:
        body = json.dumps({"username": "admin", "password": self.admin_password()}).encode()
        req = urllib.request.Request(self.api_url + "/auth/token", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())["access_token"]

    def api(self, method: str, path: str, body: dict | None = None, token: str | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.api_url + path, data=data, method=method, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {token or self.token()}",
        })
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{method} {path} -> {exc.code}: {exc.read()[:2000]!r}") from exc

    def failure_report(self, dag_id: str, run_id: str, log_lines: int = 15) -> str:
        """Which tasks of a run did not succeed, each with the last lines of its log: what a
        failed run's assertion should print, since the run's Airflow home is gone after it."""
        token = self.token()
        base = f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances"
        tis = self.api("GET", f"{base}?limit=100", token=token)["task_instances"]
        out = []
        for ti in tis:
            if ti["state"] in ("success", "skipped"):
                continue
            out.append(f"{ti['task_id']}[{ti['map_index']}] {ti['state']} try {ti['try_number']}")
            if ti["try_number"] < 1:
                continue
            try:
                log = self.api("GET", f"{base}/{ti['task_id']}/logs/{ti['try_number']}"
                               f"?map_index={ti['map_index']}&full_content=true", token=token)
            except AssertionError as exc:
                out.append(f"  (no log: {exc})")
                continue
            events = [e.get("event", e) if isinstance(e, dict) else e for e in log.get("content", [])]
            out.extend(f"  {str(e)[:500]}" for e in events[-log_lines:])
        return "\n".join(out) or "every task succeeded or was skipped"

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop_process_group(proc)

    # ``with start_airflow(env, home) as deployment:`` stops every component however the block ends.
    def __enter__(self) -> AirflowDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def unpause(self, *dag_ids: str, token: str | None = None, timeout_s: float = 120) -> None:
        """Unpause DAGs, waiting for the dag-processor to parse them (shortly after start)."""
        self.set_paused(*dag_ids, paused=False, token=token, timeout_s=timeout_s)

    def set_paused(self, *dag_ids: str, paused: bool, token: str | None = None,
                   timeout_s: float = 120) -> None:
        """Pause or unpause DAGs, waiting for the dag-processor to parse them (shortly after start)."""
        token = token or self.token()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                for dag_id in dag_ids:
                    self.api("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": paused}, token)
                return
            except AssertionError as exc:  # not parsed yet
                if time.monotonic() > deadline:
                    raise AssertionError(f"the DAGs {dag_ids} were never parsed: {exc}") from exc
                time.sleep(1)

    def lose(self, component: str) -> list[int]:
        """SIGKILL ``component`` and every process below it, as a lost node would lose them
        (a LocalExecutor's task processes are the scheduler's descendants); their pids."""
        import psutil

        proc = self.procs[COMPONENTS.index(component)]
        victims = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        return victims

    def restart(self, component: str) -> None:
        """Start ``component`` again (what compose's restart policy or a Deployment does)."""
        i = COMPONENTS.index(component)
        stop_process_group(self.procs[i])
        self.procs[i] = _start_component(self.env, self.home, component, self.api_url)


def airflow_cli(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "airflow"), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")


def _start_component(env: dict[str, str], home: Path, component: str, api_url: str) -> subprocess.Popen:
    args = [component]
    if component == "api-server":
        host, port = api_url.removeprefix("http://").rsplit(":", 1)
        args += ["--port", port, "--host", host]
    logs = home / "component-logs"
    logs.mkdir(parents=True, exist_ok=True)
    # Appended: a restarted component's log follows its predecessor's. The child keeps its own
    # descriptor of the log; ours closes with the block.
    with open(logs / f"{component}.log", "ab") as log:
        return subprocess.Popen([str(BIN / "airflow"), *args], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def start_airflow(
    env: dict[str, str], home: Path, port: int | None = None, host: str = "127.0.0.1"
) -> AirflowDeployment:
    """The four components; the api-server on ``host`` (workers on other nodes reach its execution
    API there) and ``port`` (default: a free one)."""
    port = port or free_port()
    env = {**env, "AIRFLOW__API__PORT": str(port), "AIRFLOW__API__BASE_URL": f"http://{host}:{port}",
           "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://{host}:{port}/execution/",
           "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
           "AIRFLOW__API__WORKERS": "1"}
    migrated = airflow_cli(env, "db", "migrate")
    assert migrated.returncode == 0, migrated.stderr[-3000:]
    procs: list[subprocess.Popen] = []
    logs = home / "component-logs"
    deployment = AirflowDeployment(env, f"http://{host}:{port}", procs, home)
    try:
        for component in COMPONENTS:
            procs.append(_start_component(env, home, component, deployment.api_url))

        def api_up() -> bool:
            with urllib.request.urlopen(deployment.api_url + "/api/v2/monitor/health", timeout=5) as r:
                return r.status == 200

        wait_until(api_up, 120, "Airflow api-server", procs[0], logs / "api-server.log")
        warm_execution_api(deployment.api_url)
    except BaseException:
        deployment.stop()
        raise
    return deployment


def warm_execution_api(api_url: str, timeout_s: float = 300) -> None:
    """Make the api-server build its execution API now, not at a worker's first call.

    The execution API (Cadwyn) generates its versioned routes on its first request, on the
    api-server's event loop: every request waits meanwhile. That took 9.5 s on an idle 2-core VM
    (2026-12-07, py-spy: ``Cadwyn._cadwyn_initialize``) and 36 s beside the test suite, where the
    first task's ``PATCH .../run`` outlasted the task SDK's five tries of 5 s
    (``[workers] execution_api_timeout``) and the task failed, and a REST call waiting behind it
    timed out. One request at start, as a readiness probe on ``/execution/health`` would make."""
    with urllib.request.urlopen(api_url + "/execution/health", timeout=timeout_s) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{api_url}/execution/health answered {resp.status}")


TERMINAL_RUN_STATES = ("success", "failed")


def trigger_and_wait(
    deployment: AirflowDeployment, dag_id: str, conf: dict[str, Any], timeout_s: float = 3600,
) -> dict[str, Any]:
    """Unpause ``dag_id``, trigger a run with ``conf`` and poll until it ends; the run record."""
    token = deployment.token()
    deployment.unpause(dag_id, token=token)
    run = deployment.api("POST", f"/api/v2/dags/{dag_id}/dagRuns",
                         {"logical_date": None, "conf": conf}, token)
    deadline = time.monotonic() + timeout_s
    while run["state"] not in TERMINAL_RUN_STATES:
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run['dag_run_id']} still {run['state']} after {timeout_s}s")
        time.sleep(1)
        run = deployment.api("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run['dag_run_id']}", token=token)
    return run
