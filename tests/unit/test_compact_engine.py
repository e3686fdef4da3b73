"""The suite's compact vLLM engine (serving/local_vllm.py): what a spec asks for, and only when asked."""

from __future__ import annotations

import pytest

from aibrix_operators.serving.local_vllm import COMPACT_ENGINE_ENV, VLLMServerSpec

pytestmark = pytest.mark.unit


def test_a_compact_spec_runs_the_model_in_the_engine_core_on_one_thread(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    spec = VLLMServerSpec(model="m", compact_engine=True, work_dir=tmp_path, env={"EXTRA": "1"})
    cmd = spec.command()
    at = cmd.index("--distributed-executor-backend")
    assert cmd[at + 1] == "uni"
    env = spec.environment()
    # vLLM's CPU platform turns "uni" back into "mp" unless V1 multiprocessing is off.
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == "1"
    assert env["EXTRA"] == "1" and env["TMPDIR"] == str(tmp_path / "tmp")


def test_a_default_spec_keeps_vllms_own_engine_layout(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    spec = VLLMServerSpec(model="m", work_dir=tmp_path)
    assert "--distributed-executor-backend" not in spec.command()
    assert not set(COMPACT_ENGINE_ENV) & set(spec.environment())


def test_a_spec_env_overrides_the_compact_settings(tmp_path):
    spec = VLLMServerSpec(model="m", compact_engine=True, work_dir=tmp_path, env={"OMP_NUM_THREADS": "2"})
    assert spec.environment()["OMP_NUM_THREADS"] == "2"
