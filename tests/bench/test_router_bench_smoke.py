"""Smoke test of bench/router_overhead.py at a tiny size: the script runs end to end
(stubs, router process, both baselines) and prints its table. Figures are not checked:
this machine is shared, the full-size run is for a person."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.service

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_router_overhead_main(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_router_overhead", BENCH / "router_overhead.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    rc = module.main(["--requests", "640", "--rate", "200", "--seconds", "1", "--rounds", "1", "--no-pin"])
    out = capsys.readouterr().out
    assert rc in (0, 1)  # the verdict depends on the machine, not on the code path
    for needle in ("baseline: direct calls (prefill + decode stub), closed loop 64",
                   "router (prefill + decode), closed loop 64", "router, paced 200 req/s, round 1",
                   "router throughput:", "added latency at 200 req/s", "verdict:"):  # fmt: skip
        assert needle in out
