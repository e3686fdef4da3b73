"""The package as users install it: a wheel built from what the Dockerfiles copy, holding every
module of ``plugins/aibrix_operators/`` and ``kvcache/`` and nothing else (no tests, no stale
build output), importable from where pip puts it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.service

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"aibrix_operators": REPO / "plugins" / "aibrix_operators", "kvcache": REPO / "kvcache"}


def tree_modules() -> set[str]:
    """Every .py file of the two packages, as its path inside a wheel."""
    return {
        f"{name}/{path.relative_to(root).as_posix()}"
        for name, root in PACKAGES.items()
        for path in root.rglob("*.py")
        if "__pycache__" not in path.parts
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Build from a copy of exactly what the Dockerfiles copy, as they do: an in-tree build would
    # reuse build/lib, where a module deleted from the tree can linger.
    src = tmp_path_factory.mktemp("src")
    shutil.copy(REPO / "pyproject.toml", src)
    shutil.copytree(PACKAGES["aibrix_operators"], src / "plugins" / "aibrix_operators",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    shutil.copytree(PACKAGES["kvcache"], src / "kvcache", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), str(src)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [built] = out.glob("*.whl")
    return built


def test_the_wheel_holds_every_module_and_nothing_else(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == set(PACKAGES), top
    in_wheel = {name for name in names if name.endswith(".py")}
    missing, extra = tree_modules() - in_wheel, in_wheel - tree_modules()
    assert not missing, f"left out of the wheel (a folder without __init__.py?): {sorted(missing)}"
    assert not extra, f"files in the wheel that are not in the tree: {sorted(extra)}"
    assert not [n for n in names if n.startswith("tests/") or "/tests/" in n]


def test_every_module_imports_from_the_installed_wheel(wheel, tmp_path):
    target = tmp_path / "site"
    argv = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # kvcache needs torch and vLLM (the vllm-cpu image test imports it there); the rest imports
    # here, from the installed copy and not from this checkout.
    modules = sorted(
        name[: -len(".py")].replace("/", ".").removesuffix(".__init__")
        for name in tree_modules()
        if name.startswith("aibrix_operators/") and not name.endswith("/__main__.py")  # runs a CLI
    )
    script = (
        "import importlib, sys\n"
        f"root = {str(target)!r}\n"
        "for name in sys.argv[1:]:\n"
        "    module = importlib.import_module(name)\n"
        "    assert module.__file__.startswith(root), (name, module.__file__)\n"
        "print(len(sys.argv) - 1)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    proc = subprocess.run([sys.executable, "-c", script, *modules], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.strip().splitlines()[-1]) == len(modules)
