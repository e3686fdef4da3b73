"""What a vLLM server start costs when its API server is forked from a process that has vLLM imported,
against a fresh start, alternating, in one run (issue 37: the suite's biggest CPU item is vLLM starts).

    .venv-inference/bin/python bench/vllm_fork_start.py [--rounds 2] [--model .work/models/tiny-llama]

Both starts serve the tiny model with the suite's compact engine (serving/local_vllm.py). "fresh" is
a ``VLLMServer``: ``python -m vllm.entrypoints.openai.api_server`` in a new process. "forked" is the
same command run by ``runpy`` in a fork of this process, which imported the API server's module once
at the start (its cost printed apart, paid once per process). The engine core is spawned either way:
vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``, so only the API server's imports are
saved. Each start is timed to ``/health`` answering, with the CPU of its process tree at that moment.
Must run in the inference environment (it imports vLLM).
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "plugins"))

from vllm_start import medians_line, tree_cpu  # noqa: E402 - bench/, this script's folder

from aibrix_operators.serving.local_vllm import VLLMServer, VLLMServerSpec  # noqa: E402
from aibrix_operators.serving.ports import free_port  # noqa: E402
from aibrix_operators.serving.process import probe  # noqa: E402


def spec_for(model: str) -> VLLMServerSpec:
    return VLLMServerSpec(model=model, served_model_name="tiny-llama", compact_engine=True, port=free_port())


def fresh_start(model: str) -> tuple[float, float]:
    server = VLLMServer(spec_for(model))
    started = time.monotonic()
    server.start()
    try:
        assert server.proc is not None
        return time.monotonic() - started, tree_cpu(server.proc.pid)
    finally:
        server.stop()


def forked_start(model: str, log_dir: Path) -> tuple[float, float]:
    spec = spec_for(model)
    command, env = spec.command(), spec.environment()
    assert command[1] == "-m", command
    log = log_dir / f"vllm-forked-{spec.port}.log"
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the server: its own group (stopped as a whole), its log, its environment
        code = 1
        try:
            os.setsid()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.clear()
            os.environ.update(env)
            sys.argv = [command[2], *command[3:]]
            runpy.run_module(command[2], run_name="__main__", alter_sys=True)
            code = 0
        finally:
            os._exit(code)
    try:
        deadline = started + 600
        while probe(f"http://127.0.0.1:{spec.port}/health") is not None:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done or time.monotonic() > deadline:
                raise RuntimeError(f"the forked server did not come up; see {log}")
            time.sleep(0.2)
        return time.monotonic() - started, tree_cpu(pid)
    finally:
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        time.sleep(2)  # the engine core (the group's other member) exits after its parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default=str(REPO / ".work" / "models" / "tiny-llama"))
    args = parser.parse_args()
    log_dir = REPO / ".work" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    cpu0, wall0 = time.process_time(), time.monotonic()
    import vllm.entrypoints.openai.api_server  # noqa: F401 - what every fork then finds imported

    print(f"this process imported vLLM's API server once: {time.monotonic() - wall0:.1f} s, "
          f"{time.process_time() - cpu0:.1f} CPU-s", flush=True)  # fmt: skip
    results: dict[str, list[tuple[float, float]]] = {"fresh": [], "forked": []}
    for round_no in range(1, args.rounds + 1):
        for kind in ("fresh", "forked"):
            seconds, cpu = fresh_start(args.model) if kind == "fresh" else forked_start(args.model, log_dir)
            results[kind].append((seconds, cpu))
            print(f"round {round_no} {kind:6s}: healthy after {seconds:5.1f} s, {cpu:5.1f} CPU-s", flush=True)
    print(medians_line("fresh", results["fresh"], "forked", results["forked"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
