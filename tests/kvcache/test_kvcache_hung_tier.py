"""Issue 19, finding 6 (the time bound): an fs tier on a mount whose reads hang in the kernel.

The mount is a real FUSE file system (``hung_fs.py``, its own process) that answers ``stat``
and never answers ``read``: the reader is blocked in ``read(2)`` exactly as on a stuck NFS
mount, where no Python-level timeout can interrupt it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_kvcache_worker import BS, DIM2, HEADS, _step, _worker

from kvcache import codec
from kvcache.metadata import ChunkTransfer, KVCacheStepMetadata
from kvcache.tiers import FilesystemStore, TierUnavailable

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 0.5


def _unmount(path: Path) -> None:
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    for cmd in ([tool, "-u", "-z", str(path)] if tool else None, ["umount", "-l", str(path)]):
        if cmd and subprocess.run(cmd, capture_output=True).returncode == 0:
            return


@pytest.fixture
def hung_mount(tmp_path: Path) -> Iterator[Path]:
    """A directory on which every file is 'there' but no read ever returns."""
    mount = tmp_path / "l2"
    mount.mkdir()
    size = 64  # under every record bound here: the reader gets as far as read(2)
    daemon = subprocess.Popen([sys.executable, str(HERE / "hung_fs.py"), str(mount), str(size)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while not os.path.ismount(mount):
        if daemon.poll() is not None or time.monotonic() > deadline:
            out = daemon.stdout.read().decode() if daemon.poll() is not None else ""
            daemon.kill()
            pytest.fail(f"could not mount the hung FUSE file system at {mount} (needs /dev/fuse and "
                        f"fusermount3 from the fuse3 package): {out}")
        time.sleep(0.05)
    try:
        yield mount
    finally:
        daemon.kill()  # the hung reads now fail (ENOTCONN) and their threads return
        daemon.wait()
        _unmount(mount)


def _in_thread(fn, limit_s: float):
    """Run fn in a thread; fail the test (not hang it) if it does not return within limit_s.

    Every call on the hung mount goes through here: a thread blocked in a FUSE read ignores
    SIGTERM, so a regression must fail the test, never hang the suite. The fixture's
    teardown then kills the file system's process, which releases the blocked read."""
    box: dict[str, object] = {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    t0 = time.monotonic()
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"the call was still blocked after {limit_s}s"
    return box, time.monotonic() - t0


@pytest.mark.service
def test_a_read_hung_in_the_kernel_is_a_miss_within_the_timeout(hung_mount: Path) -> None:
    store = FilesystemStore(str(hung_mount), timeout_s=TIMEOUT_S, retry_s=60)
    key = "kv:ns:r0:ab:L0"
    box, took = _in_thread(lambda: store.get(key, max_bytes=1 << 20), limit_s=10)
    assert isinstance(box.get("error"), TierUnavailable), box
    assert "took over 0.5s" in str(box["error"]) and key in str(box["error"])
    assert TIMEOUT_S <= took < TIMEOUT_S + 2
    assert store.deadline.stuck == 1  # the thread is still in read(2)
    # Marked down: the next calls answer at once instead of costing a timeout each.
    box, took = _in_thread(lambda: store.present([[key]]), limit_s=5)
    assert isinstance(box.get("error"), TierUnavailable) and took < 0.2, (box, took)
    store.close()


@pytest.mark.service
def test_a_hung_shared_tier_never_blocks_the_forward_pass(hung_mount: Path, tmp_path: Path) -> None:
    """A step that loads one chunk from L1 and two from the hung tier: it finishes within the
    timeout, the two are recomputed, the L1 chunk loads its exact bytes."""
    # Chunk "l1" is in this worker's own L1 (saved by it); "h0"/"h1" only "exist" on the mount.
    worker, kv = _worker({}, FilesystemStore(str(hung_mount), timeout_s=TIMEOUT_S, retry_s=60))
    for t in kv.values():
        t[2] = torch.randn(HEADS, BS, DIM2)
    save = KVCacheStepMetadata(saves=[ChunkTransfer("l1", [(0, 2)])], chunk_tokens=BS)
    with torch.inference_mode():
        box, _ = _in_thread(lambda: _step(worker, save), limit_s=10)
    assert box.get("value") == set(), box
    loads = [ChunkTransfer("h0", [(0, 10)]), ChunkTransfer("l1", [(0, 11)]), ChunkTransfer("h1", [(0, 12)])]

    def load() -> set[int]:
        with torch.inference_mode():  # as in vLLM's forward
            return _step(worker, KVCacheStepMetadata(loads=loads, chunk_tokens=BS))

    box, took = _in_thread(load, limit_s=15)
    assert box.get("value") == {10, 12}, box  # recomputed by vLLM; never wrong tokens
    assert took < 2 * TIMEOUT_S + 3, took  # one timeout (then down), not one per block and layer
    assert all(torch.equal(t[11], t[2]) for t in kv.values())
    worker.shutdown()


@pytest.mark.service
def test_hung_threads_are_bounded(hung_mount: Path) -> None:
    store = FilesystemStore(str(hung_mount), timeout_s=1.0, retry_s=0)
    for i in range(store.deadline.threads):
        box, _ = _in_thread(lambda i=i: store.get(f"kv:ns:r0:a{i}:L0", max_bytes=1 << 20), limit_s=5)
        assert isinstance(box.get("error"), TierUnavailable) and "took over" in str(box["error"]), box
    assert store.deadline.stuck == store.deadline.threads
    # Every thread is stuck: refused at once, no new thread, no queue growing behind them.
    box, took = _in_thread(lambda: store.get("kv:ns:r0:zz:L0", max_bytes=1 << 20), limit_s=5)
    assert isinstance(box.get("error"), TierUnavailable) and "still hung" in str(box["error"]), box
    assert took < 0.5  # no wait for a timeout (1 s): refused before a thread is asked
    prefix = store.deadline.thread_prefix
    assert sum(t.name.startswith(prefix) for t in threading.enumerate()) == store.deadline.threads
    store.close()


def test_the_tier_works_again_once_the_mount_answers(tmp_path: Path) -> None:
    """retry_s after a timeout the tier is tried again; a healthy directory then serves."""
    store = FilesystemStore(str(tmp_path), timeout_s=TIMEOUT_S, retry_s=0.2)
    t = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    key = "kv:ns:r0:aa:L0"
    store.put(key, codec.encode(key, t))
    release = threading.Event()
    real_read = store._read
    calls = {"n": 0}

    def first_call_hangs(k: str, max_bytes: int | None) -> bytes | None:
        calls["n"] += 1
        if calls["n"] == 1:
            release.wait()
        return real_read(k, max_bytes)

    store._read = first_call_hangs  # type: ignore[method-assign]
    try:
        box, _ = _in_thread(lambda: store.get(key), limit_s=5)
        assert isinstance(box.get("error"), TierUnavailable), box
        box, _ = _in_thread(lambda: store.get(key), limit_s=5)
        assert isinstance(box.get("error"), TierUnavailable) and "marked down" in str(box["error"]), box
        time.sleep(0.3)
        box, _ = _in_thread(lambda: store.get(key), limit_s=5)
        out, _ = codec.decode(box["value"], codec.Expected(key, t.dtype, tuple(t.shape)))
        assert torch.equal(out, t)
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while store.deadline.stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.deadline.stuck == 0
    store.close()
