"""L2 on a filesystem directory (a shared volume between prefill and decode pods).

Every call is bounded in size (reads: the record size the layout implies), in kind (regular
files only, no links, no blocking open) and in time (``deadline.DeadlineRunner``: a read
stuck in the kernel, as on a hung NFS mount, is a miss after ``timeout_s``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

from kvcache.tiers.base import RecordRefused, TierUnavailable
from kvcache.tiers.deadline import DeadlineRunner


class FilesystemStore:
    """One file per record, in a fan-out directory below the root; writes go to a temp file
    renamed into place (atomic).

    Every access is made relative to a directory descriptor opened without following links
    (``O_NOFOLLOW`` covers only a path's last component): a link planted at a fan-out
    directory would otherwise send records, derived from prompts, out of the tier, and serve
    reads from elsewhere. The root itself is the deployment's, and may be a link.
    """

    name = "fs"

    def __init__(self, root: str, timeout_s: float = 1.0, retry_s: float = 1.0) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.deadline = DeadlineRunner("fs", timeout_s, retry_s)

    def _path(self, key: str) -> Path:
        fan, name = self._names(key)
        return self.root / fan / name

    @staticmethod
    def _names(key: str) -> tuple[str, str]:
        # Keys are "kv:<ns>:r<rank>:<hash>:L<layer>"; fan out by hash to keep directories small.
        safe = key.replace(":", "_")
        parts = key.split(":")
        fan = parts[3][:2] if len(parts) > 3 else "00"
        if "/" in safe or fan in ("", ".", ".."):
            raise RecordRefused(f"{key!r} cannot name a file of this tier")
        return fan, safe

    def _open_fan(self, fan: str, create: bool) -> int | None:
        """The fan-out directory's descriptor (None: absent); a link or a non-directory there
        is refused."""
        if create:
            try:
                os.mkdir(fan, 0o755, dir_fd=self._root_fd)
            except FileExistsError:
                pass
        try:
            return os.open(fan, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                           dir_fd=self._root_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise RecordRefused(f"{self.root / fan}: not a directory of this tier (a link?)") from exc
            raise TierUnavailable(str(exc)) from exc

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        return self.deadline.run(f"the read of {key}", self._read, key, max_bytes)

    def put(self, key: str, record: bytes) -> None:
        self.deadline.run(f"the write of {key}", self._write, key, record)

    def present(self, groups: list[list[str]]) -> list[bool]:
        return self.deadline.run("an existence check", self._present, groups)

    def close(self) -> None:
        self.deadline.close()
        os.close(self._root_fd)

    def _read(self, key: str, max_bytes: int | None) -> bytes | None:
        fan, name = self._names(key)
        fan_fd = self._open_fan(fan, create=False)
        if fan_fd is None:
            return None
        # O_NONBLOCK: a FIFO planted at the path opens at once instead of blocking the forward
        # pass; O_NOFOLLOW: a symlink (to /dev/zero, say) is refused; the fstat below refuses
        # anything but a regular file, and the size bound what one read may take.
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fan_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise RecordRefused(f"{key}: a symbolic link, not a record") from exc
            raise TierUnavailable(str(exc)) from exc
        finally:
            os.close(fan_fd)
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
        fan, name = self._names(key)
        try:
            fan_fd = self._open_fan(fan, create=True)
            assert fan_fd is not None
            try:
                tmp = f".tmp-{secrets.token_hex(8)}"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                             dir_fd=fan_fd)
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(record)
                    os.replace(tmp, name, src_dir_fd=fan_fd, dst_dir_fd=fan_fd)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=fan_fd)
                    raise
            finally:
                os.close(fan_fd)
        except (OSError, RecordRefused) as exc:  # nowhere to write it: the write is dropped, counted
            raise TierUnavailable(str(exc)) from exc

    def _present(self, groups: list[list[str]]) -> list[bool]:
        return [all(self._is_record(k) for k in group) for group in groups]

    def _is_record(self, key: str) -> bool:
        fan, name = self._names(key)
        try:
            fan_fd = self._open_fan(fan, create=False)
        except RecordRefused:
            return False  # a lookup: what cannot be read is not there
        if fan_fd is None:
            return False
        try:
            return stat.S_ISREG(os.stat(name, dir_fd=fan_fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False
        finally:
            os.close(fan_fd)
