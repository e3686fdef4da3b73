"""build.py builds one image at a time on a checkout: `make test` builds the big images beside the
parallel pass, and a test that asks for one meanwhile must wait for that build, not race it."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BUILD_PY = Path(__file__).resolve().parents[2] / "inference_images" / "build.py"


def load_build(monkeypatch: pytest.MonkeyPatch, lock: Path):
    spec = importlib.util.spec_from_file_location("image_build_under_test", BUILD_PY)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "LOCK", lock)
    return module


def test_a_second_build_waits_for_the_first(monkeypatch, tmp_path):
    build = load_build(monkeypatch, tmp_path / "nested" / "image-build.lock")
    entered = threading.Event()

    def second() -> None:
        with build.build_lock():
            entered.set()

    with build.build_lock():
        waiter = threading.Thread(target=second, daemon=True)
        waiter.start()
        # flock locks belong to the open file, so a second open in this process conflicts as a
        # second build.py process's would.
        assert not entered.wait(0.5), "a second build went ahead while the first held the lock"
    assert entered.wait(5), "the second build never got the lock after the first released it"
    waiter.join(5)


def test_the_lock_is_released_when_a_build_fails(monkeypatch, tmp_path):
    build = load_build(monkeypatch, tmp_path / "image-build.lock")
    with pytest.raises(build.BuildError), build.build_lock():
        raise build.BuildError("podman build failed")
    started = time.monotonic()
    with build.build_lock():
        pass
    assert time.monotonic() - started < 1
