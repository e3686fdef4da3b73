"""bench/eval_scoring.py runs end to end at small sizes and prints its measurements.

Like the other smoke tests (test_bench_smoke.py), this checks that the script runs and reports,
not its timing targets: those are for a full-size run on a quiet machine, and asserting them in a
suite that runs beside vLLM servers failed a clean-clone run (a 40-night report took 5.8 s
against 5 s).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.service

REPO = Path(__file__).resolve().parents[2]


def test_eval_bench_smoke(capsys):
    spec = importlib.util.spec_from_file_location("eval_scoring", REPO / "bench" / "eval_scoring.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    code = module.main(["--items", "3000", "--nights", "40"])
    out = capsys.readouterr().out
    scored = re.search(r"^score 3,000 items .*: ([0-9.]+) s \(target < \d+ s\) score=([0-9.]+)$", out, re.M)
    reported = re.search(r"^report over 40 nights .*: ([0-9.]+) s \(target < \d+ s\)$", out, re.M)
    assert scored and reported, out
    assert 0.0 < float(scored.group(2)) <= 1.0  # a mean of per-item scores in [0, 1]
    verdict = out.strip().splitlines()[-1]
    assert (code, verdict) in {(0, "PASS"), (1, "FAIL")}, out
