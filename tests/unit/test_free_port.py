"""free_port picks ports outside the kernel's ephemeral range (serving/local_vllm.py): a port an
outgoing connection can be given as its local port between the probe and the server's bind is a
flaky start (the Celery leg's api-server, EADDRINUSE; docs/testing.md)."""

from __future__ import annotations

import socket

from aibrix_operators.serving.local_vllm import PORTS_FROM, _ephemeral_low, free_port


def test_ports_come_from_below_the_ephemeral_range_and_bind_on_every_address() -> None:
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(PORTS_FROM <= p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 1  # drawn, not one fixed port
    with socket.socket() as s:
        s.bind(("0.0.0.0", ports.pop()))  # what a server binding any address will do


def test_a_port_in_use_is_never_handed_out(monkeypatch) -> None:
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr("aibrix_operators.serving.local_vllm.PORTS_FROM", taken)
        monkeypatch.setattr("aibrix_operators.serving.local_vllm._ephemeral_low", lambda: taken + 1002)
        assert {free_port() for _ in range(30)} <= set(range(taken + 1, taken + 1002))


def test_an_unreadable_range_falls_back_to_linux_default(tmp_path) -> None:
    assert _ephemeral_low(str(tmp_path / "missing")) == 32768
    (tmp_path / "range").write_text("40000\t60999\n")
    assert _ephemeral_low(str(tmp_path / "range")) == 40000
