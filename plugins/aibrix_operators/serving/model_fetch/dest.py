"""The fetch's destination: folders and files opened without following a link, and the journal
of verified files (``model_fetch.py`` says why: another writer may share the volume)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import threading
from pathlib import Path
from typing import Any

from aibrix_operators.serving.model_manifest import ManifestFile

EXIT_FAILED = 1  # anything else (a local disk error, ...)
EXIT_USAGE = 2  # bad arguments, or a manifest that is unusable or does not match its pin
EXIT_MISSING = 3  # an object the manifest lists is not in the store
EXIT_MISMATCH = 4  # an object's size or sha256 is not the manifest's
EXIT_STORE = 5  # the store refused or could not be reached (after boto3's retries)

JOURNAL = "verified.jsonl"


class FetchError(Exception):
    """A fetch that cannot complete; ``str()`` is the one-line reason, ``exit_code`` its kind."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def not_real(shown: str, needed: str, parent_fd: int | None, name: str | Path) -> FetchError:
    """A path that must be a real ``needed`` (directory, regular file) is not: one line naming it."""
    try:
        to: str | None = os.readlink(name, dir_fd=parent_fd)
    except OSError:
        to = None  # not a link (EINVAL), or gone meanwhile
    if to is not None:
        return FetchError(
            f"{shown}: is a symbolic link (to {to!r}), not a {needed}; the fetcher follows no links "
            "in its destination (another writer may have planted it): remove the link and fetch again",
            EXIT_USAGE,
        )
    return FetchError(f"{shown}: is not a {needed}; remove it and fetch again", EXIT_USAGE)


def open_dir(name: str | Path, parent_fd: int | None, shown: str) -> int:
    """A real folder ``name`` (in ``parent_fd``), created if missing, opened without following
    a link; a FetchError naming ``shown`` if it is a link or not a folder."""
    try:
        os.mkdir(name, 0o755, dir_fd=parent_fd)
    except FileExistsError:
        pass  # mkdir never follows a link in the last component
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            raise not_real(shown, "directory", parent_fd, name) from exc
        raise


def open_regular(
    name: str, parent_fd: int, flags: int, mode: int = 0o644
) -> tuple[int, os.stat_result] | None:
    """``name`` in ``parent_fd`` opened without following a link, and its fstat; None if it is a
    link or not a regular file (then nothing was opened: a FIFO would not block, O_NONBLOCK)."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            return None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd, st


def sha256_fd(fd: int) -> str:
    digest = hashlib.sha256()
    with open(fd, "rb", buffering=0, closefd=False) as fh:
        while block := fh.read(8 * 1024 * 1024):
            digest.update(block)
    return digest.hexdigest()


class Journal:
    """``verified.jsonl`` in the state folder (a descriptor, never a path through a link): one
    line per file accepted, appended and fsynced after its rename."""

    def __init__(self, state_fd: int, shown: str) -> None:
        self.state_fd, self.shown = state_fd, shown
        self._lock = threading.Lock()
        self._fd: int | None = None

    def _refuse(self) -> FetchError:
        return not_real(self.shown, "regular file", self.state_fd, JOURNAL)

    def load(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        try:
            opened = open_regular(JOURNAL, self.state_fd, os.O_RDONLY)
        except FileNotFoundError:
            return out
        if opened is None:
            raise self._refuse()
        fd, _ = opened
        with open(fd, "rb") as fh:
            lines = fh.read().splitlines()
        for line in lines:
            try:
                entry = json.loads(line)
                out[entry["path"]] = entry
            except (ValueError, KeyError, TypeError):
                continue  # a line torn by a crash mid-append: that file is re-hashed
        return out

    def record(self, f: ManifestFile, mtime_ns: int) -> None:
        line = json.dumps({"path": f.path, "size": f.size, "sha256": f.sha256, "mtime_ns": mtime_ns}) + "\n"
        with self._lock:
            if self._fd is None:
                opened = open_regular(JOURNAL, self.state_fd, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                if opened is None:
                    raise self._refuse()
                if opened[1].st_nlink != 1:  # a hard link: appending would change another name's file
                    os.close(opened[0])
                    raise FetchError(
                        f"{self.shown}: has {opened[1].st_nlink} names (a hard link); "
                        "remove it and fetch again",
                        EXIT_USAGE,
                    )
                self._fd = opened[0]
            view = memoryview(line.encode())
            while view:
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
