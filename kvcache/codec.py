"""Self-describing records for KV blocks stored outside the engine.

A record carries its own key, dtype, shape and a crc32 of the payload. On load the key,
the layout and the checksum are all checked, so a record written for another prefix,
another layout, or damaged on the way is rejected (and recomputed), never used.
"""

from __future__ import annotations

import json
import math
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


# One sampled 8-byte word per this many bytes (a page): 1/512 of the words, and at most
# one cache line per page is read.
_SAMPLE_EVERY = 4096


def fingerprint(tensor: torch.Tensor) -> int:
    """A cheap check of a contiguous CPU tensor: crc32 of one 8-byte word per 4 KiB plus
    the last word, seeded with the byte length.

    For L1 (memory of this process) only. It catches what goes wrong there: a slot
    overwritten or reused, a wrong offset, zeroed or unfilled memory. It does not catch a
    flipped bit between two samples; records that leave the process (L2) carry a full
    crc32 of every byte instead.
    """
    return fingerprints(tensor.unsqueeze(0))[0]


def fingerprints(batch: torch.Tensor) -> list[int]:
    """``fingerprint`` of each ``batch[i]`` (contiguous), with one sampling op for all."""
    n = batch.shape[0]
    flat = batch.detach().reshape(n, -1).view(torch.uint8)
    nbytes = flat.shape[1]
    if n == 0 or nbytes == 0:
        return [0] * n
    words = flat.view(torch.int64) if nbytes % 8 == 0 else flat
    step = max(1, _SAMPLE_EVERY // words.element_size())
    sample = torch.cat((words[:, ::step], words[:, -1:]), dim=1).numpy()
    seed = nbytes & 0xFFFFFFFF
    return [zlib.crc32(memoryview(row), seed) for row in sample]


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

    Raises IntegrityError on any mismatch, and on anything malformed: records come from a
    shared tier that others can write to, so no content of one may raise anything else
    (it would reach vLLM's forward). The tensor aliases ``record`` (no copy).
    """
    try:
        return _decode(record, expected, verify)
    except IntegrityError:
        raise
    except Exception as exc:  # a malformed record is a miss, whatever the parser tripped on
        raise IntegrityError(f"malformed record: {type(exc).__name__}: {exc}") from exc


def _decode(
    record: bytes | bytearray | memoryview, expected: Expected, verify: bool
) -> tuple[torch.Tensor, int]:
    view = memoryview(record).cast("B")
    if len(view) < _HEAD.size:
        raise IntegrityError("record too short")
    magic, header_len = _HEAD.unpack_from(view)
    if magic != _MAGIC:
        raise IntegrityError("bad magic")
    if _HEAD.size + header_len > len(view):
        raise IntegrityError("truncated header")
    try:
        header = json.loads(bytes(view[_HEAD.size : _HEAD.size + header_len]))
    except ValueError as exc:
        raise IntegrityError(f"bad header: {exc}") from exc
    if not isinstance(header, dict):
        raise IntegrityError("header is not an object")
    if header.get("key") != expected.key:
        raise IntegrityError(f"key mismatch: {header.get('key')!r} != {expected.key!r}")
    dtype = str(expected.dtype).removeprefix("torch.")
    shape = header.get("shape")
    if header.get("dtype") != dtype or not isinstance(shape, list) or tuple(shape) != expected.shape:
        raise IntegrityError("layout mismatch")
    # The payload must hold exactly the expected shape's bytes: the header's own nbytes
    # could agree with a short payload.
    nbytes = math.prod(expected.shape) * torch.empty((), dtype=expected.dtype).element_size()
    payload = view[_HEAD.size + header_len :]
    if len(payload) != nbytes or header.get("nbytes") != nbytes:
        raise IntegrityError("payload size mismatch")
    crc = header.get("crc32")
    if type(crc) is not int or not 0 <= crc <= 0xFFFFFFFF:
        raise IntegrityError("bad crc32 field")
    with warnings.catch_warnings():
        # Read-only buffers (bytes from Redis) are fine: we only copy out of them.
        warnings.simplefilter("ignore", UserWarning)
        tensor = (
            torch.frombuffer(payload, dtype=expected.dtype).view(expected.shape)
            if len(payload)
            else (torch.empty(expected.shape, dtype=expected.dtype))
        )
    if verify and checksum(tensor) != crc:
        raise IntegrityError("checksum mismatch")
    return tensor, crc


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())
