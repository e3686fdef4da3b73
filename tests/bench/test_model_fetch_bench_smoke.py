"""bench/model_fetch.py end to end at a tiny size (a real SeaweedFS): it runs and prints its table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.service

BENCH = Path(__file__).resolve().parents[2] / "bench" / "model_fetch.py"


def test_model_fetch_bench_runs_every_method(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_model_fetch", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.main(["--mb", "12", "--rounds", "1", "--work", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for method in module.METHODS:
        assert f"| {method} |" in out
    assert list(tmp_path.iterdir()) == []  # the scratch directory is removed
