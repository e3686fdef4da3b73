"""bench/gpu_kvcache.py must run (small sizes, CPU) so its code is tested without a GPU."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_kvcache.py"


def test_gpu_bench_runs_on_cpu_and_checks_loaded_kv(capsys) -> None:
    spec = importlib.util.spec_from_file_location("gpu_kvcache", BENCH)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_kvcache"] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    # run() asserts that the KV loaded through the worker equals the KV saved through it.
    r = mod.main(["--device", "cpu", "--preset", "small", "--steps", "1", "--json"])
    for op in ("save", "load"):
        for k in ("compute_s", "sync_s", "pipelined_s", "speedup", "hidden_frac"):
            assert f"{op}_{k}" in r
        assert r[f"{op}_sync_s"] > 0 and 0.0 <= r[f"{op}_hidden_frac"] <= 1.0
    assert '"preset": "small"' in capsys.readouterr().out


@pytest.mark.service  # one bench process per tree
def test_device_check_runs_both_trees_on_cpu_and_writes_its_table(tmp_path) -> None:
    """bench/device_check.py's CPU mode: this tree and a baseline tree, JSON and Markdown out."""
    baseline = tmp_path / "baseline"
    shutil.copytree(BENCH.parents[1] / "kvcache", baseline / "kvcache")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(BENCH.with_name("device_check.py")), str(out), "--device", "cpu",
         "--preset", "small", "--steps", "1", "--baseline", str(baseline)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "device_check.json").read_text())
    runs = [(r["preset"], r["tree"]) for r in result["runs"]]
    assert runs == [("small", "this"), ("small", "baseline (baseline)")]
    assert all(0.0 <= r[f"{op}_hidden_frac"] <= 1.0 for r in result["runs"] for op in ("save", "load"))
    assert result["l2_read"]["decode_gbps"] > 0
    md = (out / "device_check.md").read_text()
    assert "| small | this |" in md and "| small | baseline (baseline) |" in md and "L2 read path" in md
