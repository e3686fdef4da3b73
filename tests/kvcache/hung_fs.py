"""A FUSE file system whose reads never return: a stuck NFS mount, for real.

``python hung_fs.py MOUNTPOINT SIZE``: every name below the mount point is a regular file of
SIZE bytes (``stat`` answers at once, as a hung NFS server's cached attributes do) whose
``read`` blocks inside the kernel until this process is killed. Run as its own process, so
the reader under test is blocked in a real system call, not in Python.
"""

from __future__ import annotations

import stat
import sys
import threading
import time

import mfusepy as fuse


class HungFS(fuse.Operations):
    def __init__(self, size: int) -> None:
        self.size = size
        self.forever = threading.Event()

    def getattr(self, path: str, fh: int | None = None) -> dict[str, float]:
        now = time.time()
        times = {"st_atime": now, "st_mtime": now, "st_ctime": now}
        if path == "/" or len(path) == 3:  # the root and the tier's fan-out directories "/ab"
            return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2, **times}
        return {"st_mode": stat.S_IFREG | 0o644, "st_nlink": 1, "st_size": self.size, **times}

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", ".."]

    def open(self, path: str, flags: int) -> int:
        return 0

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        self.forever.wait()  # the server never answers
        return b""


if __name__ == "__main__":
    fuse.FUSE(HungFS(int(sys.argv[2])), sys.argv[1], foreground=True, nothreads=False, direct_io=True)
