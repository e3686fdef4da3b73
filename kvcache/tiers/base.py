"""The interface every shared (L2) tier implements."""

from __future__ import annotations

from typing import Protocol


class TierUnavailable(Exception):
    """The tier cannot be reached right now; callers treat it as a miss."""


class RecordRefused(Exception):
    """What is stored under a key cannot be a record (too large, not a regular file): a miss."""


class L2Store(Protocol):
    """A byte store shared between processes. Keys are printable ASCII."""

    name: str

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        """The record, or None when absent. Raises TierUnavailable when unreachable.

        With ``max_bytes`` (what the layout implies), an object larger than that, or one that
        is not a plain stored value, is refused as ``RecordRefused`` without reading it whole:
        whoever else can write the tier must not be able to hang or exhaust the reader.
        """
        ...

    def put(self, key: str, record: bytes) -> None:
        """Store a record (atomically: readers never see half of it)."""
        ...

    def present(self, groups: list[list[str]]) -> list[bool]:
        """For each group of keys, whether all of them exist (one round trip where possible)."""
        ...

    def close(self) -> None: ...
