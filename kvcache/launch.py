"""Build vLLM launch lines for this connector, and run a local server (tests, benches).

``kv_transfer_config(...)`` is the JSON for ``--kv-transfer-config``; ``LocalServer`` starts
an OpenAI-compatible vLLM server on 127.0.0.1, waits until it is healthy and stops it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

# free_port is the package's one port picker (below the ephemeral range: no outgoing connection can
# take the port before the server binds it); the connector tests import it from here.
from aibrix_operators.serving.local_vllm import COMPACT_ENGINE_ARGS, COMPACT_ENGINE_ENV, free_port
from aibrix_operators.serving.process import VLLM_STARTUP_TIMEOUT_S, ServerProcess, tail

REPO = Path(__file__).resolve().parent.parent


def kv_transfer_config(extra: dict[str, Any] | None = None, role: str = "kv_both") -> dict[str, Any]:
    """``--kv-transfer-config`` for KVCacheConnector with the given extra_config."""
    return {
        "kv_connector": "KVCacheConnector",
        "kv_connector_module_path": "kvcache.connector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra or {}),
    }


class LocalServer:
    """A vLLM OpenAI server on 127.0.0.1 (CPU), started and stopped by the caller."""

    def __init__(
        self,
        model: str,
        *,
        kv_config: dict[str, Any] | None = None,
        prefix_caching: bool = False,
        max_model_len: int = 4096,
        kv_cache_bytes: int = 512 << 20,
        threads_bind: str | None = None,
        log_path: str | Path | None = None,
        work_dir: str | Path | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        dev_mode: bool = False,
        compact_engine: bool = False,
    ) -> None:
        """``compact_engine``: the model in vLLM's engine-core process on one OpenMP thread
        (aibrix_operators.serving.local_vllm.COMPACT_ENGINE_ENV/ARGS), for the tests' many small
        servers; off, vLLM's default (a worker process of its own), as deployments run it."""
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        work = Path(work_dir or REPO / ".work")
        (work / "tmp").mkdir(parents=True, exist_ok=True)
        (work / "cache").mkdir(parents=True, exist_ok=True)
        self.log_path = Path(log_path or work / f"vllm-{self.port}.log")
        self.cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", str(max_model_len),
            "--kv-cache-memory-bytes", str(kv_cache_bytes), "--enforce-eager",
            "--enable-prompt-tokens-details", "--disable-log-stats",
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        ]  # fmt: skip
        if kv_config is not None:
            self.cmd += ["--kv-transfer-config", json.dumps(kv_config)]
        if compact_engine:
            self.cmd += COMPACT_ENGINE_ARGS
        self.cmd += list(extra_args or [])
        self.env = dict(os.environ)
        if threads_bind is not None:
            # Pin the same way in every compared run: vLLM's automatic choice differs
            # with and without a connector on small machines.
            self.env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
        self.env.update(
            VLLM_CACHE_ROOT=str(work / "cache"),
            TMPDIR=str(work / "tmp"),
            HF_HUB_OFFLINE="1",
            PYTHONPATH=os.pathsep.join(p for p in (str(REPO), self.env.get("PYTHONPATH", "")) if p),
        )
        if compact_engine:
            self.env.update(COMPACT_ENGINE_ENV)
        if dev_mode:
            # vLLM's dev endpoints, among them POST /reset_prefix_cache (tests, benches).
            self.env["VLLM_SERVER_DEV_MODE"] = "1"
        self.env.update(env or {})
        self.prefix_caching = prefix_caching
        self.process: ServerProcess | None = None

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.process.proc if self.process is not None else None

    def start(self, timeout_s: float = VLLM_STARTUP_TIMEOUT_S) -> LocalServer:
        # The launcher shared with aibrix_operators.serving: own process group, health wait,
        # and a stop that takes the engine child even when the API server already exited.
        self.process = ServerProcess(self.cmd, self.env, self.log_path, name="vLLM", append_log=False)
        self.process.start().wait_healthy(self.url + "/health", timeout_s)
        return self

    def tail(self, n: int = 40) -> str:
        return tail(self.log_path, n)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(grace_s=30)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- client ------------------------------------------------------------------------
    def reset_prefix_cache(self, timeout_s: float = 30.0) -> None:
        """Empty vLLM's own prefix cache (not the connector's tiers), so the next request
        must compute or load every token. Needs ``dev_mode``. vLLM refuses while requests
        hold blocks; retried until idle."""
        deadline = time.monotonic() + timeout_s
        while True:
            req = urllib.request.Request(self.url + "/reset_prefix_cache", data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=10) as r:
                if json.loads(r.read() or b"{}").get("success", True):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("vLLM kept refusing to reset its prefix cache")
            time.sleep(0.1)

    def complete(
        self,
        prompt: str | list[int] | list[list[int]],
        max_tokens: int = 8,
        logprobs: int | None = 1,
        timeout_s: float = 300.0,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Greedy /v1/completions; returns the parsed JSON response. ``extra``: more body
        fields (e.g. ``cache_salt``)."""
        body: dict[str, Any] = {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "seed": 0, **(extra or {}),
        }  # fmt: skip
        if logprobs is not None:
            body["logprobs"] = logprobs
        req = urllib.request.Request(
            self.url + "/v1/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())


def cached_tokens(response: dict[str, Any]) -> int:
    details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)
