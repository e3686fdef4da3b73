"""Build and run this repository's images with podman, for the image smoke tests.

Images come from ``inference_images/build.py`` (what ``make images`` runs), so a test always
runs what this checkout's Dockerfiles build: after ``make images`` the build is a cache hit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

from tests.k8s_double.podman import PODMAN, RUN_FLAGS

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "inference_images" / "build.py"


def build(name: str) -> dict:
    """Build one image (cached); its tag, size and build time. A failed build fails the test
    with the build's own last lines.

    build.py builds one image at a time on this checkout (its lock): a test that asks while a
    ``make images`` builds the image waits for that build, then hits the cache; two pytest-xdist
    workers asking at once wait for each other the same way."""
    proc = subprocess.run([sys.executable, str(BUILD), name, "--json"], capture_output=True,
                          text=True, timeout=3600, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, f"building {name} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(
    image: str, *args: str, flags: list[str] = (), timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``podman run`` to completion (``args`` after the image: the CMD, or the entrypoint's args)."""
    return subprocess.run([*PODMAN, "run", *RUN_FLAGS, *flags, image, *args],
                          capture_output=True, text=True, timeout=timeout, env=env)  # fmt: skip


def inspect(image: str, fmt: str) -> str:
    proc = subprocess.run(
        [*PODMAN, "image", "inspect", "--format", fmt, image], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def last_error_line(proc: subprocess.CompletedProcess) -> str:
    """The line a crashing entrypoint ends on (``ModuleNotFoundError: ...``), for assertion messages."""
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    return lines[-1] if lines else f"(no output, exit {proc.returncode})"


def answers_200(url: str) -> Callable[[], bool]:
    """A readiness check for ``Detached.wait_until``: ``url`` answers 200."""

    def ready() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=3) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    return ready


class Detached:
    """A container started with ``podman run -d``, stopped and removed on exit."""

    def __init__(self, image: str, *args: str, flags: list[str] = ()) -> None:
        self.name = f"aibrix-test-{uuid.uuid4().hex[:10]}"
        # No --rm: an exited container keeps its log for the assertion message; __exit__ removes it.
        kept = [flag for flag in RUN_FLAGS if flag != "--rm"]
        self.argv = [*PODMAN, "run", "-d", "--name", self.name, *kept, *flags, image, *args]

    def __enter__(self) -> Detached:
        proc = subprocess.run(self.argv, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"podman run failed: {proc.stderr[-2000:]}"
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run([*PODMAN, "rm", "--force", "--time", "5", self.name], capture_output=True, timeout=60)

    def running(self) -> bool:
        proc = subprocess.run([*PODMAN, "inspect", "--format", "{{.State.Running}}", self.name],
                              capture_output=True, text=True)  # fmt: skip
        return proc.stdout.strip() == "true"

    def logs(self) -> str:
        proc = subprocess.run([*PODMAN, "logs", self.name], capture_output=True, text=True)
        return proc.stdout + proc.stderr

    def wait_until(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            if not self.running():
                raise AssertionError(f"{what}: the container exited; its log ends:\n{self.logs()[-4000:]}")
            time.sleep(0.5)
        raise AssertionError(
            f"{what}: not ready in {timeout} s; the container log ends:\n{self.logs()[-4000:]}"
        )
