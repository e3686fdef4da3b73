"""The router image installs what the router imports, and nothing of Airflow or vLLM."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROUTER = REPO / "plugins" / "aibrix_operators" / "router"
IMAGE = REPO / "inference_images" / "router"
# import name -> distribution name in requirements.txt
DISTRIBUTIONS = {"aiohttp": "aiohttp", "orjson": "orjson", "prometheus_client": "prometheus-client",
                 "uvloop": "uvloop", "yaml": "PyYAML"}  # fmt: skip


def third_party_imports() -> set[str]:
    """What the router's modules import, and the package modules they import (the registry)."""
    found: set[str] = set()
    todo, seen = list(ROUTER.glob("*.py")), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.startswith("aibrix_operators."):
                    todo.append(REPO / "plugins" / (name.replace(".", "/") + ".py"))
            found |= {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"__future__",
                                                                                        "aibrix_operators"}
    return found


def test_router_imports_only_what_its_image_pins() -> None:
    imports = third_party_imports()
    assert not imports & {"airflow", "vllm", "torch", "kvcache"}
    assert imports <= set(DISTRIBUTIONS), imports - set(DISTRIBUTIONS)
    pins = {line.split("==")[0] for line in (IMAGE / "requirements.txt").read_text().splitlines()
            if line and not line.startswith("#")}  # fmt: skip
    assert {DISTRIBUTIONS[i] for i in imports} <= pins
    assert all("==" in line for line in (IMAGE / "requirements.txt").read_text().splitlines()
               if line and not line.startswith("#"))  # fmt: skip


def test_dockerfile_runs_the_router_as_non_root() -> None:
    text = (IMAGE / "Dockerfile").read_text()
    assert "USER 65532:65532" in text and "HEALTHCHECK" in text
    assert 'ENTRYPOINT ["python", "-m", "aibrix_operators.router"]' in text
    assert ":latest" not in text
