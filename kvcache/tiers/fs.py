"""L2 on a filesystem directory (a shared volume between prefill and decode pods)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvcache.tiers.base import TierUnavailable


class FilesystemStore:
    """One file per record; writes go to a temp file and are renamed into place (atomic)."""

    name = "fs"

    def __init__(self, root: str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        # Keys are "kv:<ns>:r<rank>:<hash>:L<layer>"; fan out by hash to keep directories small.
        safe = key.replace(":", "_")
        parts = key.split(":")
        fan = parts[3][:2] if len(parts) > 3 else "00"
        return self.root / fan / safe

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TierUnavailable(str(exc)) from exc

    def put(self, key: str, record: bytes) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(record)
            os.replace(tmp, path)
        except OSError as exc:
            raise TierUnavailable(str(exc)) from exc

    def present(self, groups: list[list[str]]) -> list[bool]:
        return [all(self._path(k).exists() for k in group) for group in groups]

    def close(self) -> None:
        return None
