"""bench/gpu_kvcache.py must run (small sizes, CPU) so its code is tested without a GPU."""

import importlib.util
import sys
from pathlib import Path

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
