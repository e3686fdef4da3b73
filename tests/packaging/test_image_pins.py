"""Every shipped image is reproducible and runs as non-root: pinned bases (no moving tag), pinned
pip requirements, a non-root USER, one folder per image under inference_images/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "inference_images"
DOCKERFILES = sorted(IMAGES.glob("*/Dockerfile"))
REQUIREMENTS = sorted({*IMAGES.glob("*/requirements*.txt"), REPO / "requirements.txt"})


def test_one_folder_convention_for_every_dockerfile():
    everywhere = {p.relative_to(REPO).as_posix() for p in REPO.rglob("Dockerfile")
                  if not {".venv", ".venv-inference", ".work"} & set(p.parts)}  # fmt: skip
    assert everywhere == {p.relative_to(REPO).as_posix() for p in DOCKERFILES}
    assert {p.parent.name for p in DOCKERFILES} == {"airflow", "batch_driver", "router", "vllm", "vllm_cpu"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_bases_are_pinned_and_overridable(dockerfile):
    text = dockerfile.read_text()
    [default] = re.findall(r"^ARG BASE_IMAGE=(\S+)$", text, re.M)
    repo, _, tag = default.rpartition(":")
    assert repo and re.search(r"\d", tag) and tag != "latest", default  # a released version
    for base in re.findall(r"^FROM (\S+)", text, re.M):
        assert base == "${BASE_IMAGE}", f"{dockerfile}: FROM {base} does not use the BASE_IMAGE argument"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_every_pip_install_is_pinned_and_the_image_runs_as_non_root(dockerfile):
    text = dockerfile.read_text().replace("\\\n", " ")
    for line in re.findall(r"pip install ([^&\n]*)", text):
        packages = [w.strip("\"'") for w in line.split() if not w.startswith(("-", "/", "$"))]
        unpinned = [p for p in packages if "==" not in p]
        assert not unpinned, f"{dockerfile}: unpinned {unpinned} in `pip install {line}`"
    final_stage = text.split("\nFROM ")[-1]
    users = re.findall(r"^USER (\S+)", final_stage, re.M)
    assert users and users[-1] not in ("0", "root", "0:0"), f"{dockerfile} runs as root"


@pytest.mark.parametrize("requirements", REQUIREMENTS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_image_requirement_is_pinned(requirements):
    for line in requirements.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            pinned = re.fullmatch(r"[A-Za-z0-9_.\-]+(\[[a-z0-9,]+\])?==[0-9][^ ]*", line)
            assert pinned, f"{requirements}: {line} is not pinned with =="
