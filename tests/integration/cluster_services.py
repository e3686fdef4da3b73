"""PostgreSQL and Redis for the multi-node tests: private instances on 127.0.0.1, free ports.

What the official Helm chart runs beside Airflow by default (a PostgreSQL metadata database, a
Redis broker for the CeleryExecutor), started from the machine's own binaries: PostgreSQL's
server (Debian's ``postgresql`` package, ``make test`` installs it) and ``redis-server``.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from aibrix_operators.local_airflow import wait_until
from aibrix_operators.serving.local_vllm import free_port
from aibrix_operators.serving.local_vllm import stop_process_group as stop_group

__all__ = ["Postgres", "postgres", "redis_broker"]


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or [shutil.which(name) or ""]
    if not found[-1]:
        raise FileNotFoundError(f"PostgreSQL's {name} not found: apt-get install postgresql")
    return found[-1]  # the newest major version installed


@dataclass(frozen=True)
class Postgres:
    port: int
    user: str = "airflow"
    database: str = "airflow"
    host: str = "127.0.0.1"

    def url(self, driver: str = "") -> str:
        """``postgresql://`` (SQLAlchemy 2.1: psycopg 3), or ``postgresql+<driver>://``."""
        scheme = f"postgresql+{driver}" if driver else "postgresql"
        return f"{scheme}://{self.user}@{self.host}:{self.port}/{self.database}"


@contextmanager
def postgres(also_on: str | None = None, clients: str | None = None) -> Iterator[Postgres]:
    """A throwaway cluster: initdb, the server on a free port (trust auth on loopback only),
    one database; removed afterwards. PostgreSQL refuses to run as root, so as root its files and
    process belong to the ``postgres`` user the Debian package creates. ``also_on``: one more
    address to listen on, trusting clients from the ``clients`` network (the multi-node tests'
    bridge)."""
    as_root = os.geteuid() == 0
    run_as = ["runuser", "-u", "postgres", "--"] if as_root else []
    # Not under pytest's tmp tree: its root is private to the user running the tests.
    data_root = Path(tempfile.mkdtemp(prefix="aibrix-pg-"))
    data, sockets = data_root / "data", data_root / "sockets"
    sockets.mkdir()
    if as_root:
        shutil.chown(data_root, "postgres")
        shutil.chown(sockets, "postgres")
    server = Postgres(port=free_port(), host=also_on or "127.0.0.1")
    proc = None
    try:
        subprocess.run([*run_as, _pg_bin("initdb"), "-D", str(data), "-U", server.user, "-A", "trust",
                        "-E", "UTF8", "--no-sync"], check=True, capture_output=True, text=True)
        if also_on and clients:
            with open(data / "pg_hba.conf", "a") as hba:
                hba.write(f"host all all {clients} trust\n")
        log = data_root / "postgres.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [*run_as, _pg_bin("postgres"), "-D", str(data), "-p", str(server.port),
                 "-h", ",".join(filter(None, ["127.0.0.1", also_on])), "-k", str(sockets), "-c", "fsync=off"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

        def accepting() -> bool:
            return subprocess.run([_pg_bin("pg_isready"), "-h", "127.0.0.1", "-p", str(server.port)],
                                  capture_output=True).returncode == 0

        wait_until(accepting, 60, "PostgreSQL", proc, log)
        subprocess.run([_pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(server.port), "-U", server.user,
                        server.database], check=True, capture_output=True, text=True)
        yield server
    finally:
        if proc is not None:
            stop_group(proc)
        shutil.rmtree(data_root, ignore_errors=True)


@contextmanager
def redis_broker(also_on: str | None = None) -> Iterator[str]:
    """redis-server on a free loopback port (and ``also_on``), nothing persisted; its ``redis://``
    URL (on ``also_on`` when given)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server not found: apt-get install redis-server")
    port = free_port()
    binds = ["127.0.0.1", *([also_on] if also_on else [])]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", *binds, "--save", "",
                             "--appendonly", "no", "--protected-mode", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        import redis

        client = redis.Redis(port=port)
        wait_until(lambda: bool(client.ping()), 30, "redis-server", proc)
        yield f"redis://{also_on or '127.0.0.1'}:{port}/0"
    finally:
        stop_group(proc)
