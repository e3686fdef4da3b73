"""The interface every shared (L2) tier implements."""

from __future__ import annotations

from typing import Protocol


class TierUnavailable(Exception):
    """The tier cannot be reached right now; callers treat it as a miss."""


class L2Store(Protocol):
    """A byte store shared between processes. Keys are printable ASCII."""

    name: str

    def get(self, key: str) -> bytes | None:
        """The record, or None when absent. Raises TierUnavailable when unreachable."""
        ...

    def put(self, key: str, record: bytes) -> None:
        """Store a record (atomically: readers never see half of it)."""
        ...

    def present(self, groups: list[list[str]]) -> list[bool]:
        """For each group of keys, whether all of them exist (one round trip where possible)."""
        ...

    def close(self) -> None: ...
