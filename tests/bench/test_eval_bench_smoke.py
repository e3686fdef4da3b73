"""bench/eval_scoring.py runs (small sizes) and meets its own targets."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_eval_bench_smoke(capsys):
    spec = importlib.util.spec_from_file_location("eval_scoring", REPO / "bench" / "eval_scoring.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--items", "3000", "--nights", "40"]) == 0
    out = capsys.readouterr().out
    assert "score 3,000 items" in out and "report over 40 nights" in out and "PASS" in out
