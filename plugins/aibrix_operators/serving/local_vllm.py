"""Start and stop a local vLLM OpenAI-compatible server in its own environment.

vLLM and Airflow live in separate virtualenvs, so the server runs as a
subprocess of the inference environment's Python. Used by ``make run``, the
end-to-end tests and the benchmarks; in production vLLM runs in its own pods.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_PYTHON = REPO_ROOT / ".venv-inference" / "bin" / "python"
DEFAULT_WORK = REPO_ROOT / ".work"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class VLLMServerSpec:
    model: str
    served_model_name: str | None = None
    port: int = 0
    max_model_len: int = 4096
    kv_cache_bytes: int = 512 * 1024 * 1024
    runner: str | None = None  # "pooling" for embedding models
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
            "--disable-uvicorn-access-log",
        ]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self.runner:
            cmd += ["--runner", self.runner]
        return cmd + list(self.extra_args)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM a process started with ``start_new_session=True`` and all its children;
    SIGKILL what is left after ``grace_s``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


class VLLMServer:
    """A running server; use as a context manager so it is always stopped."""

    def __init__(self, spec: VLLMServerSpec) -> None:
        if not spec.port:
            spec.port = free_port()
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"

    def start(self, timeout_s: float = 240.0) -> VLLMServer:
        spec = self.spec
        if not spec.python.exists():
            raise FileNotFoundError(
                f"inference environment not found at {spec.python}; run `make setup` first"
            )
        cache = spec.work_dir / "cache"
        tmp = spec.work_dir / "tmp"
        cache.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ, "VLLM_CACHE_ROOT": str(cache), "TMPDIR": str(tmp),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1", "HF_HOME": str(cache / "hf"), **spec.env,
        }
        log_path = spec.log_path or (spec.work_dir / "logs" / f"vllm-{spec.port}.log")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            spec.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,  # its own process group: stop() takes the engine too
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(
                    f"vLLM exited with code {self.proc.returncode} during startup; see {log_path}:\n"
                    + _tail(log_path)
                )
            if self.healthy():
                return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vLLM did not become healthy in {timeout_s:.0f}s; see {log_path}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, grace_s)
        if self._log is not None:
            self._log.close()
            self._log = None

    def start_in_background(self, timeout_s: float = 240.0) -> threading.Thread:
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


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
