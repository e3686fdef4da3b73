"""No class in ``kvcache/`` is over 300 lines: a class that size does more than one job (the
worker was ~550 before its data path moved behind the transfer engine's job API)."""

from __future__ import annotations

import ast
from pathlib import Path

KVCACHE = Path(__file__).resolve().parents[2] / "kvcache"
MAX_CLASS_LINES = 300


def class_sizes(root: Path) -> dict[str, int]:
    """``path:Class`` -> lines, from the class statement to its last line (decorators excluded)."""
    sizes = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                sizes[f"{path.relative_to(root.parent)}:{node.name}"] = node.end_lineno - node.lineno + 1
    return sizes


def test_no_class_in_kvcache_is_over_300_lines() -> None:
    sizes = class_sizes(KVCACHE)
    assert "kvcache/worker.py:KVCacheWorker" in sizes and "kvcache/transfer_engine.py:TransferEngine" in sizes
    over = {name: n for name, n in sizes.items() if n > MAX_CLASS_LINES}
    assert not over, f"classes over {MAX_CLASS_LINES} lines: {over}"


def test_the_size_counts_a_class_from_its_first_to_its_last_line(tmp_path: Path) -> None:
    pkg = tmp_path / "kvcache"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    (pkg / "big.py").write_text(f"import os\n\n\nclass Big:\n{body}\n\n\nclass Small:\n    pass\n")
    assert class_sizes(pkg) == {"kvcache/big.py:Big": MAX_CLASS_LINES + 1, "kvcache/big.py:Small": 2}
