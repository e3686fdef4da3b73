"""What a vLLM server start costs with and without Python's bytecode cache, alternating, in one run.

    python bench/vllm_start.py [--rounds 2] [--model .work/models/tiny-llama]

Each start is a ``VLLMServer`` (serving/local_vllm.py, the tests' servers) of the tiny model,
timed from the start to ``/health`` answering; its CPU is the sum over the server's process tree
(the API server, its engine core and worker) at that moment. "no cache" runs the server as a
fresh clone on these VMs did before the Makefile's fix: ``PYTHONDONTWRITEBYTECODE=1`` and no
compiled module anywhere (``PYTHONPYCACHEPREFIX`` an empty folder, so the venv's own
``__pycache__`` folders are not read either); "cache" with the variable empty and a cache a
warm-up start (not counted) filled. Prints one line per start and the ratios of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "plugins"))

from aibrix_operators.serving.local_vllm import VLLMServer, VLLMServerSpec  # noqa: E402


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process and everything below it, now."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def medians_line(base: str, base_runs: list[tuple[float, float]], other: str,
                 other_runs: list[tuple[float, float]]) -> str:
    """The medians of two kinds of start, (seconds, CPU-s) each, and their ratios other/base."""
    b_s, b_cpu = (statistics.median(x[i] for x in base_runs) for i in (0, 1))
    o_s, o_cpu = (statistics.median(x[i] for x in other_runs) for i in (0, 1))
    return (f"median {base}: {b_s:.1f} s, {b_cpu:.1f} CPU-s; {other}: {o_s:.1f} s, {o_cpu:.1f} CPU-s; "
            f"ratio {other}/{base}: time {o_s / b_s:.2f}, CPU {o_cpu / b_cpu:.2f}")


def one_start(model: str, cache_dir: Path | None) -> tuple[float, float]:
    """(seconds to healthy, CPU seconds of the server's processes by then); ``cache_dir``: the
    bytecode cache to use and fill, or None for none at all."""
    prefix = str(cache_dir) if cache_dir is not None else tempfile.mkdtemp(prefix="no-pyc-")
    env = {"PYTHONPYCACHEPREFIX": prefix, "PYTHONDONTWRITEBYTECODE": "" if cache_dir is not None else "1"}
    spec = VLLMServerSpec(model=model, served_model_name="tiny-llama", env=env)
    server = VLLMServer(spec)
    started = time.monotonic()
    server.start()
    try:
        seconds = time.monotonic() - started
        assert server.proc is not None
        return seconds, tree_cpu(server.proc.pid)
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default=str(REPO / ".work" / "models" / "tiny-llama"))
    args = parser.parse_args()
    cache_dir = Path(tempfile.mkdtemp(prefix="pyc-"))
    one_start(args.model, cache_dir)  # fills the cache the "cache" rounds read
    results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for round_no in range(1, args.rounds + 1):
        for cache in (False, True):
            seconds, cpu = one_start(args.model, cache_dir if cache else None)
            results[cache].append((seconds, cpu))
            print(f"round {round_no} {'cache   ' if cache else 'no cache'}: healthy after {seconds:5.1f} s, "
                  f"{cpu:5.1f} CPU-s", flush=True)  # fmt: skip
    print(medians_line("no cache", results[False], "cache", results[True]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
