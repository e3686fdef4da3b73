"""Ports for the local servers this package starts (``make run``, the tests, the benches).

``free_port()`` answers a TCP port that no socket holds now and that no other caller on this
machine was handed in the last ``PORT_LEASE_S`` seconds. Two rules, each from a failure:

- *Below the kernel's ephemeral range* (``ip_local_port_range``): a port from ``bind(0)`` comes from
  that range, and between the probe and the server's own bind any outgoing connection on the machine
  may get it as its local port. That happened: the Celery leg's api-server failed with EADDRINUSE on
  10.213.x.1:44323 while the scheduler beside it was connecting to PostgreSQL (docs/testing.md).
  Below the range only an explicit bind can take a port.
- *Leased across processes*: a probe alone cannot see a port another process picked and has not
  bound yet. The connector's lookahead test picks its second server's metrics port a minute before
  that server binds it; in CI that server's engine core died at start-up while the other xdist
  worker was starting servers of its own, as it does when its metrics port is taken (reproduced;
  docs/testing.md). Every caller records what it was handed in one file under a lock, and no caller
  is handed a leased port.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["PORTS_FROM", "PORT_LEASE_S", "free_port"]

PORTS_FROM = 20000  # the range starts here: clear of the usual services (5432, 6379, 8000s)
# Long enough for the slowest gap between a pick and its bind (a vLLM start-up under load, a test
# that picks a second server's ports before the first one runs); short enough that the leases held
# at once stay a small share of the range (~13k ports; the suite picks a few thousand in all).
PORT_LEASE_S = 900.0
# One file for every process on the machine, whatever each one's TMPDIR.
LEASES = Path("/tmp/aibrix-port-leases.json")


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts there


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))  # every address: a server may bind any of them
        except OSError:
            return False
        return True


def _read(path: Path, now: float) -> dict[int, float]:
    try:
        raw = json.loads(path.read_text() or "{}")
        return {int(p): float(t) for p, t in raw.items() if float(t) > now}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}  # missing or torn: start again (a lease is a courtesy between our own callers)


def _pick(low: int, leased: dict[int, float]) -> int | None:
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(PORTS_FROM, low)
        if port not in leased and _bindable(port):
            return port
    return None


@contextlib.contextmanager
def _leases(path: Path) -> Iterator[dict[int, float]]:
    """The live leases, held under the lock; what the caller adds is written back. Without a
    writable lock file (no shared /tmp), an empty table: ports are then probed only."""
    try:
        lock = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield {}
        return
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        leased = _read(path, time.time())
        before = len(leased)
        yield leased
        if len(leased) != before:
            tmp = path.with_name(f"{path.name}.{os.getpid()}")
            try:
                tmp.write_text(json.dumps({str(p): t for p, t in leased.items()}))
                os.replace(tmp, path)
            except OSError:
                pass  # another user's file in a sticky /tmp: the port stays probed only
    finally:
        os.close(lock)


def free_port(leases: Path | None = None) -> int:
    """A TCP port for a server started next (see the module's docstring for the two rules)."""
    low = _ephemeral_low()
    if low > PORTS_FROM + 1000:
        with _leases(leases or LEASES) as leased:
            port = _pick(low, leased)
            if port is not None:
                leased[port] = time.time() + PORT_LEASE_S
                return port
    with socket.socket() as s:  # an unusual range, or no free port in it: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
