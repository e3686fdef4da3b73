"""free_port (serving/ports.py) picks ports outside the kernel's ephemeral range, and never hands
out a port another caller on the machine was handed within its lease: a port an outgoing connection
can take between the probe and the server's bind, or one a second picker draws before the first one's
server binds it, is a flaky start (the Celery leg's api-server and the connector's lookahead test;
docs/testing.md)."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from aibrix_operators.serving import ports
from aibrix_operators.serving.ports import PORTS_FROM, _ephemeral_low, free_port


@pytest.fixture
def narrow(monkeypatch, tmp_path) -> tuple[int, Path]:
    """A 1002-port range of its own (free now on this machine's probe), and a leases file of its own."""
    monkeypatch.setattr(ports, "PORTS_FROM", 21000)
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 22002)
    return 21000, tmp_path / "leases.json"


def test_ports_come_from_below_the_ephemeral_range_and_bind_on_every_address(tmp_path) -> None:
    low = _ephemeral_low()
    picked = {free_port(tmp_path / "leases.json") for _ in range(20)}
    assert all(PORTS_FROM <= p < low for p in picked), (sorted(picked), low)
    assert len(picked) > 1  # drawn, not one fixed port
    with socket.socket() as s:
        s.bind(("0.0.0.0", picked.pop()))  # what a server binding any address will do


def test_a_port_in_use_is_never_handed_out(monkeypatch, tmp_path) -> None:
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "PORTS_FROM", taken)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: taken + 1002)
        got = {free_port(tmp_path / "leases.json") for _ in range(30)}
        assert got <= set(range(taken + 1, taken + 1002))


def test_a_leased_port_is_not_handed_out_again_though_nothing_bound_it(narrow) -> None:
    # 300 draws from 1002 ports: without the leases dozens repeat (birthday bound: ~45 expected).
    low, leases = narrow
    got = [free_port(leases) for _ in range(300)]
    assert len(set(got)) == 300
    recorded = {int(p) for p in json.loads(leases.read_text())}
    assert recorded == set(got)


def test_expired_and_torn_leases_are_dropped(narrow) -> None:
    low, leases = narrow
    leases.write_text(json.dumps({str(low + i): time.time() - 1 for i in range(1002)}))
    free_port(leases)  # every lease has expired: a port is found in the range and the rest are pruned
    assert len(json.loads(leases.read_text())) == 1
    leases.write_text('{"21')
    assert low <= free_port(leases) < low + 1002


def _draw(args: tuple[str, int]) -> list[int]:
    path, n = args
    return [free_port(Path(path)) for _ in range(n)]


def test_two_callers_drawing_at_once_never_get_the_same_port(narrow) -> None:
    # Threads stand in for processes (a unit test starts none): each call opens the lock file
    # itself, and flock excludes open files from one another, whichever process holds them.
    _, leases = narrow
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(_draw, [(str(leases), 150), (str(leases), 150)])
    assert len(set(a) | set(b)) == 300


def test_an_unreadable_range_falls_back_to_linux_default(tmp_path) -> None:
    assert _ephemeral_low(str(tmp_path / "missing")) == 32768
    (tmp_path / "range").write_text("40000\t60999\n")
    assert _ephemeral_low(str(tmp_path / "range")) == 40000
