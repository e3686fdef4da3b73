"""LocalServer's compact engine (kvcache/launch.py): the same settings as the suite's other servers
(serving/local_vllm.py), only when asked; the default stays vLLM's own layout, as deployments run
it (test_kvcache_lora.py keeps it, so the connector's metadata still crosses to a worker process)."""

from __future__ import annotations

from aibrix_operators.serving.local_vllm import COMPACT_ENGINE_ARGS, COMPACT_ENGINE_ENV
from kvcache.launch import LocalServer


def test_a_compact_server_runs_the_model_in_the_engine_core_on_one_thread(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    server = LocalServer("m", compact_engine=True, work_dir=tmp_path, extra_args=["--max-num-seqs", "1"])
    at = server.cmd.index("--distributed-executor-backend")
    assert server.cmd[at:at + 2] == COMPACT_ENGINE_ARGS == ["--distributed-executor-backend", "uni"]
    assert server.cmd[-2:] == ["--max-num-seqs", "1"]  # the caller's arguments still come last
    assert server.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and server.env["OMP_NUM_THREADS"] == "1"


def test_a_default_server_keeps_vllms_own_engine_layout(tmp_path, monkeypatch):
    for key in COMPACT_ENGINE_ENV:
        monkeypatch.delenv(key, raising=False)
    server = LocalServer("m", work_dir=tmp_path)
    assert "--distributed-executor-backend" not in server.cmd
    assert not set(COMPACT_ENGINE_ENV) & set(server.env)


def test_a_callers_env_overrides_the_compact_settings(tmp_path):
    server = LocalServer("m", compact_engine=True, work_dir=tmp_path, env={"OMP_NUM_THREADS": "2"})
    assert server.env["OMP_NUM_THREADS"] == "2"
