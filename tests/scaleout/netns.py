"""Machines for the multi-node tests: Linux network namespaces on a bridge the test makes.

``Network`` makes a bridge in the test's own namespace (the control node: it keeps the first
address of a private /24) and one namespace per worker node, each with a veth on the bridge, its
own address, its own hostname (a UTS namespace) and its own temporary folder (``TMPDIR``); each
node's Airflow home is its own folder too, and batches go through S3: nothing passes between
nodes but the network. Traffic goes only to loopback and to
addresses on this bridge. ``Node.lose()`` kills every process in a node's namespace at once, as a
machine that loses power. Needs root (``ip netns``); everything is removed on exit.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


def free_subnet() -> ipaddress.IPv4Network:
    """A private /24 in 10.213.0.0/16 that no route of this machine's covers."""
    routes = _ip("-4", "route", "show", "table", "all")
    taken = {ipaddress.ip_network(w.split()[0], strict=False) for w in routes.splitlines()
             if w and w.split()[0][0].isdigit()}  # fmt: skip
    start = os.getpid() % 200
    for i in range(200):
        net = ipaddress.ip_network(f"10.213.{(start + i) % 200 + 20}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError("no free 10.213.x.0/24 for the test network")


@dataclass
class Node:
    """A worker machine: a network namespace with its own hostname and temporary folder."""

    name: str
    netns: str
    address: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """Run ``argv`` on this node, its output appended to ``log``; its temporary files go to
        the node's own folder beside the log (``TMPDIR``)."""
        # A UTS namespace with the node's hostname. Not a tmpfs over /tmp: a checkout (and its
        # venv) under /tmp, as a CI clone may be, would vanish from the node's view.
        tmp = log.parent / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        setup = f'hostname {self.name} && exec "$@"'
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--", "sh", "-c", setup, "sh", *argv],
                env={**env, "TMPDIR": str(tmp)}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)  # fmt: skip
        self.procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def lose(self) -> float:
        """Kill every process on the node at once (SIGKILL); returns when, in ``time.time()``."""
        lost_at = time.time()
        for _ in range(5):  # a process forking while we kill: kill again until none is left
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        for proc in self.procs:
            proc.wait(30)
        return lost_at


@dataclass
class Network:
    bridge: str
    control_address: str
    nodes: dict[str, Node]
    prefix: int


@contextmanager
def network(names: list[str]) -> Iterator[Network]:
    """A bridge with the control node's address and one namespace per name in ``names``."""
    tag = f"{os.getpid() % 100000:05d}"
    subnet = free_subnet()
    hosts = list(subnet.hosts())
    bridge = f"ab{tag}"
    made: list[str] = []
    nodes: dict[str, Node] = {}
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{hosts[0]}/{subnet.prefixlen}", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, name in enumerate(names, start=1):
            netns, veth = f"aibrix-{tag}-{name}", f"av{tag}{i}"
            _ip("netns", "add", netns)
            made.append(netns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            _ip("link", "set", veth, "master", bridge)
            _ip("link", "set", veth, "up")
            _ip("link", "set", f"{veth}p", "netns", netns)
            _ip("-n", netns, "link", "set", f"{veth}p", "name", "eth0")
            address = str(hosts[10 + i])
            _ip("-n", netns, "addr", "add", f"{address}/{subnet.prefixlen}", "dev", "eth0")
            _ip("-n", netns, "link", "set", "eth0", "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            nodes[name] = Node(name, netns, address)
        yield Network(bridge, str(hosts[0]), nodes, subnet.prefixlen)
    finally:
        for node in nodes.values():
            node.lose()
        for netns in made:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
