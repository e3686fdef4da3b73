"""The README's quick start ends when its stack cannot start (first-hour review, 2026-12-05).

The wait loop used to spin forever after ``serve_batch_api.py`` exited with a 45-line traceback,
and a missing model said nothing like "run ``make run`` first". The loop is taken from the README
as printed, with only the stack's command replaced, and run in bash."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.service

REPO = Path(__file__).resolve().parents[2]
SERVE = ".venv/bin/python scripts/serve_batch_api.py"


def readme_wait_loop() -> list[str]:
    """The quick start's start-and-wait lines, as the README prints them."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(\.venv/bin/python scripts/serve_batch_api\.py .*?)\nexport ", text, re.S)
    assert block, "the README's quick start no longer starts with serve_batch_api.py"
    lines = block.group(1).splitlines()
    assert lines[0].startswith(SERVE + " > .work/stack.log")
    return lines


def run_loop(tmp_path: Path, command: str) -> subprocess.CompletedProcess[str]:
    lines = readme_wait_loop()
    script = "\n".join([lines[0].replace(SERVE, command), *lines[1:]]).replace(".work/stack.log",
                                                                                 str(tmp_path / "stack.log"))
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_a_missing_model_fails_at_once_saying_what_to_do(tmp_path: Path) -> None:
    command = f"{sys.executable} scripts/serve_batch_api.py --model {tmp_path / 'no-model'}"
    proc = run_loop(tmp_path, command)
    assert proc.stdout.strip() == (f"failed: no model at {tmp_path / 'no-model'}: run `make run` first (it "
                                   "sets up both environments and generates the model), or pass --model")


def test_the_loop_ends_when_the_stack_dies_without_a_word(tmp_path: Path) -> None:
    # A crash before any line of ours (an import error, a kill): the loop must not wait forever.
    proc = run_loop(tmp_path, f"{sys.executable} -c 'import sys; print(\"Traceback: boom\"); sys.exit(3)'")
    assert "Traceback: boom" in proc.stdout
