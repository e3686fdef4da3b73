"""train_eval_model.py's lock: a key check shares it with the adapter's training (which reads the base
model for minutes), and training the model still waits for every reader."""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[2] / "inference_images" / "vllm" / "train_eval_model.py"


@pytest.fixture
def trainer(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("AIBRIX_MODEL_CACHE", "off")  # the machine's cache: test_model_cache.py
    spec = importlib.util.spec_from_file_location("train_eval_model_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_train(out: Path, config: dict[str, Any]) -> dict[str, Any]:
    """What train() leaves for the key check (the weights' files), without torch."""
    degraded = out.parent / (out.name + "-degraded")
    degraded.mkdir(parents=True, exist_ok=True)
    (degraded / "model.safetensors").write_bytes(b"w")
    return {"steps": config["steps"]}


def _main_in_thread(trainer: Any, out: Path) -> threading.Thread:
    thread = threading.Thread(target=trainer.main, args=([str(out)],), daemon=True)
    thread.start()
    return thread


def test_a_current_model_is_found_while_the_adapter_reads_it(trainer: Any, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "eval-llama"
    monkeypatch.setattr(trainer, "train", _fake_train)
    trainer.main([str(out)])  # trains (the fake) and writes the key
    assert (out / "train_key.txt").read_text().strip() == trainer.cache_key(trainer.CONFIG)
    monkeypatch.setattr(trainer, "train", lambda *a: pytest.fail("a current model was trained again"))
    with trainer.training_lock(out, shared=True):  # what train_eval_adapter.py holds on its base
        check = _main_in_thread(trainer, out)
        check.join(10)
        assert not check.is_alive(), "the key check waited for the adapter's training"


def test_training_waits_for_every_reader(trainer: Any, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "eval-llama"
    trained: list[Path] = []
    monkeypatch.setattr(trainer, "train", lambda o, c: trained.append(o) or _fake_train(o, c))
    with trainer.training_lock(out, shared=True):
        run = _main_in_thread(trainer, out)
        run.join(1.0)
        assert run.is_alive() and trained == [], "the model was retrained under a reader"
    run.join(10)
    assert not run.is_alive() and trained == [out]
    assert json.loads((out / "training.json").read_text())["key"] == trainer.cache_key(trainer.CONFIG)
