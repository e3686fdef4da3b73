"""The machine's model cache (inference_images/vllm/model_cache.py): a model trained in one checkout
is copied into another instead of trained again, and only when it is the same model."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

SCRIPTS = Path(__file__).resolve().parents[2] / "inference_images" / "vllm"


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "machine-cache"
    monkeypatch.setenv("AIBRIX_MODEL_CACHE", str(root))
    return root


@pytest.fixture
def trainer(cache: Path) -> Any:
    return _load("train_eval_model")


def _fake_train(trained: list[Path]) -> Any:
    """What train() leaves (the weights of the model and of its degraded twin), without torch."""
    def train(out: Path, config: dict[str, Any]) -> dict[str, Any]:
        trained.append(out)
        (out / "model.safetensors").write_bytes(b"weights %d" % len(trained))
        degraded = out.parent / (out.name + "-degraded")
        degraded.mkdir(parents=True, exist_ok=True)
        (degraded / "model.safetensors").write_bytes(b"noisy weights %d" % len(trained))
        return {"steps": config["steps"]}
    return train


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_model_trained_in_one_checkout_is_copied_into_another(trainer: Any, cache: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    trained: list[Path] = []
    monkeypatch.setattr(trainer, "train", _fake_train(trained))
    first, second = tmp_path / "one" / "eval-llama", tmp_path / "two" / "eval-llama"
    trainer.main([str(first)])
    trainer.main([str(second)])
    assert trained == [first], "the second checkout trained the model again"
    for name in ("eval-llama", "eval-llama-degraded"):
        assert _files(second.parent / name) == _files(first.parent / name)
    assert trainer.up_to_date(second, trainer.CONFIG)


def test_another_library_version_or_config_trains_again(trainer: Any, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    trained: list[Path] = []
    monkeypatch.setattr(trainer, "train", _fake_train(trained))
    trainer.main([str(tmp_path / "one" / "eval-llama")])
    versions = trainer.model_cache.library_versions
    monkeypatch.setattr(trainer.model_cache, "library_versions",
                        lambda *names: versions(*names) + ";torch==99.0")
    trainer.main([str(tmp_path / "two" / "eval-llama")])
    trainer.main([str(tmp_path / "three" / "eval-llama"), "--steps", "7"])
    assert [p.parent.name for p in trained] == ["one", "two", "three"]


def test_an_entry_missing_a_folder_is_no_model(trainer: Any, cache: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry is whole or absent (written beside, then renamed); one without the degraded twin,
    say from a hand-made copy, is not taken."""
    trained: list[Path] = []
    monkeypatch.setattr(trainer, "train", _fake_train(trained))
    trainer.main([str(tmp_path / "one" / "eval-llama")])
    (entry,) = cache.iterdir()
    for f in (entry / "eval-llama-degraded").iterdir():
        f.unlink()
    (entry / "eval-llama-degraded").rmdir()
    trainer.main([str(tmp_path / "two" / "eval-llama")])
    assert len(trained) == 2


def test_off_stores_nothing(trainer: Any, cache: Path, tmp_path: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIBRIX_MODEL_CACHE", "off")
    monkeypatch.setattr(trainer, "train", _fake_train([]))
    trainer.main([str(tmp_path / "one" / "eval-llama")])
    assert not cache.exists()


def test_the_newest_entries_of_a_name_are_kept_and_no_other_names(cache: Path, tmp_path: Path) -> None:
    model_cache = _load("model_cache")
    adapter = tmp_path / "eval-llama-reverse"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"a")
    model_cache.store("eval-llama-reverse", "aaaa", [adapter])
    model = tmp_path / "eval-llama"
    model.mkdir()
    for i, key in enumerate(("01", "02", "03", "04", "05")):
        (model / "model.safetensors").write_bytes(b"%d" % i)
        model_cache.store("eval-llama", key, [model])
        (cache / f"eval-llama-{key}").touch()  # mtime order, whatever the clock's resolution
    kept = sorted(p.name for p in cache.iterdir())
    assert kept == ["eval-llama-03", "eval-llama-04", "eval-llama-05", "eval-llama-reverse-aaaa"]


def test_the_adapter_is_copied_from_the_cache_too(cache: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    base_trainer = _load("train_eval_model")
    monkeypatch.setattr(base_trainer, "train", _fake_train([]))
    adapter_trainer = _load("train_eval_adapter")
    trained: list[Path] = []

    def train(base: Path, out: Path, config: dict[str, Any]) -> dict[str, Any]:
        trained.append(out)
        for folder, body in ((out, b"lora"), (out.parent / (out.name + "-degraded"), b"noisy lora")):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "adapter_model.safetensors").write_bytes(body)
        return {"steps": config["steps"]}

    monkeypatch.setattr(adapter_trainer, "train", train)
    for checkout in ("one", "two"):
        base = tmp_path / checkout / "eval-llama"
        base_trainer.main([str(base)])
        adapter_trainer.main([str(base), str(tmp_path / checkout / "eval-llama-reverse")])
    assert trained == [tmp_path / "one" / "eval-llama-reverse"]
    one, two = (tmp_path / checkout / "eval-llama-reverse" for checkout in ("one", "two"))
    assert (two / "train_key.txt").read_text() == (one / "train_key.txt").read_text()
    degraded = two.parent / "eval-llama-reverse-degraded"
    assert (degraded / "adapter_model.safetensors").read_bytes() == b"noisy lora"


def test_library_versions_read_metadata_without_importing() -> None:
    model_cache = _load("model_cache")
    assert model_cache.library_versions("pytest", "no-such-package-xyz") == (
        f"pytest=={pytest.__version__};no-such-package-xyz absent")
