"""L2 on a filesystem directory (a shared volume between prefill and decode pods).

Every call is bounded in size (reads: the record size the layout implies), in kind (regular
files only, no links, no blocking open) and in time (``deadline.DeadlineRunner``: a read
stuck in the kernel, as on a hung NFS mount, is a miss after ``timeout_s``).
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from kvcache.tiers.base import RecordRefused, TierUnavailable
from kvcache.tiers.deadline import DeadlineRunner


class FilesystemStore:
    """One file per record; writes go to a temp file and are renamed into place (atomic)."""

    name = "fs"

    def __init__(self, root: str, timeout_s: float = 1.0, retry_s: float = 1.0) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.deadline = DeadlineRunner("fs", timeout_s, retry_s)

    def _path(self, key: str) -> Path:
        # Keys are "kv:<ns>:r<rank>:<hash>:L<layer>"; fan out by hash to keep directories small.
        safe = key.replace(":", "_")
        parts = key.split(":")
        fan = parts[3][:2] if len(parts) > 3 else "00"
        return self.root / fan / safe

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        return self.deadline.run(f"the read of {key}", self._read, key, max_bytes)

    def put(self, key: str, record: bytes) -> None:
        self.deadline.run(f"the write of {key}", self._write, key, record)

    def present(self, groups: list[list[str]]) -> list[bool]:
        return self.deadline.run("an existence check", self._present, groups)

    def close(self) -> None:
        self.deadline.close()

    def _read(self, key: str, max_bytes: int | None) -> bytes | None:
        # O_NONBLOCK: a FIFO planted at the path opens at once instead of blocking the forward
        # pass; O_NOFOLLOW: a symlink (to /dev/zero, say) is refused; the fstat below refuses
        # anything but a regular file, and the size bound what one read may take.
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise RecordRefused(f"{key}: a symbolic link, not a record") from exc
            raise TierUnavailable(str(exc)) from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise RecordRefused(f"{key}: not a regular file")
            if max_bytes is not None and info.st_size > max_bytes:
                raise RecordRefused(f"{key}: {info.st_size} bytes, over the {max_bytes} of a record")
            limit = info.st_size if max_bytes is None else max_bytes
            with os.fdopen(fd, "rb", closefd=True) as f:
                fd = -1
                data = f.read(limit + 1)
            if len(data) > limit:  # grew after the fstat
                raise RecordRefused(f"{key}: larger than {limit} bytes")
            return data
        except OSError as exc:
            raise TierUnavailable(str(exc)) from exc
        finally:
            if fd >= 0:
                os.close(fd)

    def _write(self, key: str, record: bytes) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(record)
            os.replace(tmp, path)
        except OSError as exc:
            raise TierUnavailable(str(exc)) from exc

    def _present(self, groups: list[list[str]]) -> list[bool]:
        return [all(self._path(k).exists() for k in group) for group in groups]
