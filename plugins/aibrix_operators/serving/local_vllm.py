"""Start and stop a local vLLM OpenAI-compatible server in its own environment.

vLLM and Airflow live in separate virtualenvs, so the server runs as a
subprocess of the inference environment's Python. Used by ``make run``, the
end-to-end tests and the benchmarks; in production vLLM runs in its own pods.
"""

from __future__ import annotations

import os
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from aibrix_operators.serving.ports import free_port
from aibrix_operators.serving.process import (
    VLLM_STARTUP_TIMEOUT_S,
    ServerProcess,
    healthy,
    stop_process_group,
)
from aibrix_operators.serving.scheduling_policy import MIDDLEWARE as SCHEDULING_POLICY_MIDDLEWARE

ONLINE_FIRST_MIDDLEWARE = "aibrix_operators.serving.online_first.OnlineFirst"

__all__ = ["COMPACT_ENGINE_ARGS", "COMPACT_ENGINE_ENV", "VLLMServer", "VLLMServerSpec", "free_port",
           "stop_process_group"]

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_PYTHON = REPO_ROOT / ".venv-inference" / "bin" / "python"
DEFAULT_WORK = REPO_ROOT / ".work"


# A compact engine for a small CPU host (the suite's servers): vLLM's engine core runs the model
# itself instead of beside a worker process (the uniprocess executor; vLLM's CPU platform allows it
# only with VLLM_ENABLE_V1_MULTIPROCESSING=0, which leaves the API server and the engine core
# separate processes), on one OpenMP thread. By default the engine core waits on its worker by
# spinning on shared memory (1 s after each step: vllm/distributed/device_communicators/
# shm_broadcast.py), which keeps a second core busy while the worker computes, and each of the
# worker's two OpenMP threads spins at its barriers. Measured on this 2-core VM (2026-12-07, the
# tiny model, alone): start 17 CPU-s and 18 s against 29 CPU-s and 27 s (one process fewer to
# import vLLM and torch), 1024 tokens one at a time 5.8 CPU-s against 9.5 for the same 5 s, eight
# at a time 1.9 CPU-s against 3.3. Deployments keep vLLM's defaults (the images set none of this).
COMPACT_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
COMPACT_ENGINE_ARGS = ["--distributed-executor-backend", "uni"]


@dataclass
class VLLMServerSpec:
    model: str
    served_model_name: str | None = None
    port: int = 0
    max_model_len: int = 4096
    kv_cache_bytes: int = 512 * 1024 * 1024
    runner: str | None = None  # "pooling" for embedding models
    # "priority" for an endpoint shared with online traffic (docs/shared-capacity.md): requests'
    # vLLM priority then orders admission and preemption. Reported by the middleware below.
    scheduling_policy: str = "fcfs"
    # Online first inside the server (serving/online_first.py): an online request takes a running
    # batch request's sequence slot at once. For an endpoint shared with online traffic.
    online_first: bool = False
    # COMPACT_ENGINE_ENV and COMPACT_ENGINE_ARGS (above): for the suite's many small servers.
    compact_engine: bool = False
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    python: Path = DEFAULT_PYTHON
    work_dir: Path = DEFAULT_WORK
    log_path: Path | None = None

    def command(self) -> list[str]:
        cmd = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", str(self.max_model_len),
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes), "--enforce-eager",
            "--disable-uvicorn-access-log", "--scheduling-policy", self.scheduling_policy,
            # Says the policy in a header, so the driver can check it before shared mode.
            "--middleware", SCHEDULING_POLICY_MIDDLEWARE,
        ]
        if self.online_first:
            cmd += ["--middleware", ONLINE_FIRST_MIDDLEWARE]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self.runner:
            cmd += ["--runner", self.runner]
        if self.compact_engine:
            cmd += COMPACT_ENGINE_ARGS
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        """The server's environment: this process's, offline, its caches and temporary files under
        ``work_dir`` (created here), then the compact engine's settings and ``env``."""
        cache = self.work_dir / "cache"
        tmp = self.work_dir / "tmp"
        cache.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(parents=True, exist_ok=True)
        return {
            **os.environ, "VLLM_CACHE_ROOT": str(cache), "TMPDIR": str(tmp),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1", "HF_HOME": str(cache / "hf"),
            **(COMPACT_ENGINE_ENV if self.compact_engine else {}), **self.env,
        }


class VLLMServer:
    """A running server; use as a context manager so it is always stopped."""

    def __init__(self, spec: VLLMServerSpec) -> None:
        if not spec.port:
            spec.port = free_port()
        self.spec = spec
        self.process: ServerProcess | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.process.proc if self.process is not None else None

    def start(self, timeout_s: float = VLLM_STARTUP_TIMEOUT_S) -> VLLMServer:
        spec = self.spec
        if not spec.python.exists():
            raise FileNotFoundError(
                f"inference environment not found at {spec.python}; run `make setup` first"
            )
        env = spec.environment()
        log_path = spec.log_path or (spec.work_dir / "logs" / f"vllm-{spec.port}.log")
        self.process = ServerProcess(spec.command(), env, log_path, name="vLLM").start()
        self.process.wait_healthy(self.base_url + "/health", timeout_s)
        return self

    def healthy(self) -> bool:
        return healthy(self.base_url + "/health")

    def stop(self, grace_s: float = 20.0) -> None:
        if self.process is not None:
            self.process.stop(grace_s)

    def start_in_background(self, timeout_s: float = VLLM_STARTUP_TIMEOUT_S) -> threading.Thread:
        """Start without blocking (e.g. while a DAG validates and splits); ``join`` the thread,
        then check ``startup_error``."""
        self.startup_error: BaseException | None = None

        def target() -> None:
            try:
                self.start(timeout_s)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                self.startup_error = exc

        thread = threading.Thread(target=target, name=f"vllm-start-{self.spec.port}", daemon=True)
        thread.start()
        return thread

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
