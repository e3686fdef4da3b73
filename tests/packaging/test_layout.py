"""README's Layout table is the map of the tree: every package folder and every top-level folder
has a row, and every row names something that exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def layout_paths() -> set[str]:
    """The paths of the table's first column, ``a/{b,c}/`` expanded, without trailing slashes."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("\n## Layout\n"):]
    section = section[: section.index("\n## ", 1)]
    paths: set[str] = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first_cell = line.split("|")[1]
        for path in re.findall(r"`([^`]+)`", first_cell):
            match = re.fullmatch(r"(.*)\{([^}]+)\}(.*)", path)
            expanded = [match[1] + alt + match[3] for alt in match[2].split(",")] if match else [path]
            paths |= {p.rstrip("/") for p in expanded}
    return paths


def package_folders() -> set[str]:
    return {
        init.parent.relative_to(REPO).as_posix()
        for root in ("plugins/aibrix_operators", "kvcache")
        for init in (REPO / root).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }


def top_level_folders() -> set[str]:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    return {line.split("/")[0] for line in tracked.stdout.splitlines() if "/" in line} - {".ci"}


def test_every_package_folder_has_a_row():
    missing = package_folders() - layout_paths()
    assert not missing, f"package folders missing from README's Layout table: {sorted(missing)}"


@pytest.mark.service
def test_every_top_level_folder_has_a_row():
    missing = top_level_folders() - layout_paths()
    assert not missing, f"top-level folders missing from README's Layout table: {sorted(missing)}"


def test_every_row_names_something_that_exists():
    gone = sorted(p for p in layout_paths() if not (REPO / p).exists())
    assert not gone, f"README's Layout table names paths that do not exist: {gone}"


# Issue 38: a module past this many lines does two jobs; split it rather than raise the bound.
MAX_MODULE_LINES = 500


def test_no_module_does_two_jobs_by_size():
    modules = [p for root in ("plugins/aibrix_operators", "kvcache") for p in (REPO / root).rglob("*.py")]
    sizes = {p.relative_to(REPO).as_posix(): len(p.read_text().splitlines()) for p in modules}
    over = {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES}
    assert len(sizes) > 100, "the module list is empty: the test reads nothing"
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them): {over}"
