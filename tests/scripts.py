"""Import a script that lives outside any package (bench/*.py) the way the tests use one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_script(name: str, path: Path) -> ModuleType:
    """The module of the file at path, imported as name and kept in sys.modules (dataclasses need it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
