"""Self-describing records for KV blocks stored outside the engine.

A record carries its own key, dtype, shape and a crc32 of the payload. On load the key,
the layout and the checksum are all checked, so a record written for another prefix,
another layout, or damaged on the way is rejected (and recomputed), never used.
"""

from __future__ import annotations

import json
import struct
import warnings
import zlib
from dataclasses import dataclass

import torch

_MAGIC = b"KVC1"
_HEAD = struct.Struct("<4sI")


class IntegrityError(Exception):
    """A stored record does not match what the reader expected."""


@dataclass(frozen=True)
class Expected:
    """What a reader requires of a record."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def checksum(tensor: torch.Tensor) -> int:
    """crc32 of a contiguous CPU tensor's bytes (zlib's crc32 runs at GB/s)."""
    return zlib.crc32(_bytes_view(tensor))


def encode(key: str, tensor: torch.Tensor, crc: int | None = None) -> bytes:
    """Serialise ``tensor`` (contiguous, on CPU) with its key and checksum."""
    tensor = tensor.contiguous()
    payload = _bytes_view(tensor)
    header = json.dumps(
        {
            "key": key,
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "crc32": checksum(tensor) if crc is None else crc,
            "nbytes": len(payload),
        }
    ).encode()
    return b"".join((_HEAD.pack(_MAGIC, len(header)), header, payload))


def decode(
    record: bytes | bytearray | memoryview, expected: Expected, verify: bool = True
) -> tuple[torch.Tensor, int]:
    """Parse a record and check it against ``expected``; returns (tensor, crc32).

    Raises IntegrityError on any mismatch. The tensor aliases ``record`` (no copy).
    """
    view = memoryview(record)
    if len(view) < _HEAD.size:
        raise IntegrityError("record too short")
    magic, header_len = _HEAD.unpack_from(view)
    if magic != _MAGIC:
        raise IntegrityError("bad magic")
    try:
        header = json.loads(bytes(view[_HEAD.size : _HEAD.size + header_len]))
    except ValueError as exc:
        raise IntegrityError(f"bad header: {exc}") from exc
    if header.get("key") != expected.key:
        raise IntegrityError(f"key mismatch: {header.get('key')!r} != {expected.key!r}")
    dtype = str(expected.dtype).removeprefix("torch.")
    if header.get("dtype") != dtype or tuple(header.get("shape", ())) != expected.shape:
        raise IntegrityError("layout mismatch")
    payload = view[_HEAD.size + header_len :]
    if len(payload) != header.get("nbytes"):
        raise IntegrityError("truncated payload")
    with warnings.catch_warnings():
        # Read-only buffers (bytes from Redis) are fine: we only copy out of them.
        warnings.simplefilter("ignore", UserWarning)
        tensor = (
            torch.frombuffer(payload, dtype=expected.dtype).view(expected.shape)
            if len(payload)
            else (torch.empty(expected.shape, dtype=expected.dtype))
        )
    crc = int(header.get("crc32", -1))
    if verify and checksum(tensor) != crc:
        raise IntegrityError("checksum mismatch")
    return tensor, crc


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())
