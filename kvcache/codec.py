"""Self-describing records for KV blocks stored outside the engine.

A record carries its own key, dtype, shape and a checksum of every payload byte (xxh3-64,
or zlib crc32 where the xxhash package is missing; the header names which). On load the
key, the layout and the checksum are all checked, so a record written for another prefix,
another layout, or damaged on the way is rejected (and recomputed), never used.

A checksum is not a MAC: anyone who can write to the shared tier can make a record whose
checksum matches. With a MAC key configured, every record also ends in a keyed BLAKE2b
(or BLAKE3) tag over all of its bytes, checked before anything in it is parsed, so only
holders of the key can write records that load.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
import warnings
import zlib
from dataclasses import dataclass

import numpy as np
import torch

try:  # xxh3-64: ~4x zlib's crc32 and ~2x a memory copy here, so a full check is affordable
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None  # type: ignore[assignment]

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


SUM_ALG = "xxh3_64" if xxhash is not None else "crc32"


def _sum(alg: str, data: memoryview) -> int:
    if alg == "xxh3_64" and xxhash is not None:
        return xxhash.xxh3_64_intdigest(data)
    if alg == "crc32":
        return zlib.crc32(data)
    raise IntegrityError(f"unsupported checksum {alg!r}")


def checksum(tensor: torch.Tensor) -> int:
    """Checksum (``SUM_ALG``) of every byte of a contiguous CPU tensor."""
    return _sum(SUM_ALG, _bytes_view(tensor))


def checksum_bytes(data: np.ndarray) -> int:
    """``checksum`` of a C-contiguous array's bytes (the same value as of the tensor it views)."""
    return _sum(SUM_ALG, memoryview(data).cast("B"))


_MAC_ALGS = ("blake2b", "blake3")
TAG_BYTES = 32
# A record's JSON header (key, dtype, shape, checksum) is about 200 bytes; anything past this is
# not a record of ours, and bounds what a tier read may return (max_record_bytes).
MAX_HEADER_BYTES = 4096


@dataclass(frozen=True)
class Mac:
    """A keyed MAC over whole records. ``key``: any length (hashed to 32 bytes)."""

    key: bytes
    alg: str = "blake2b"

    def __post_init__(self) -> None:
        if self.alg not in _MAC_ALGS:
            raise ValueError(f"MAC algorithm must be one of {_MAC_ALGS}, got {self.alg!r}")
        if not self.key:
            raise ValueError("empty MAC key")

    def tag(self, *parts: bytes | memoryview) -> bytes:
        key = hashlib.blake2b(self.key, digest_size=32, person=b"kvcache-mac").digest()
        if self.alg == "blake3":
            import blake3  # a vLLM dependency; only needed when chosen

            h = blake3.blake3(key=key)
        else:
            h = hashlib.blake2b(key=key, digest_size=TAG_BYTES)
        for p in parts:
            h.update(p)
        return h.digest()


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


def encode(key: str, tensor: torch.Tensor, crc: int | None = None, mac: Mac | None = None) -> bytes:
    """Serialise ``tensor`` (contiguous, on CPU) with its key and checksum (``crc``: a
    ``checksum`` computed already), and a MAC tag when ``mac`` is given."""
    tensor = tensor.contiguous()
    payload = _bytes_view(tensor)
    fields = {
        "key": key,
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "sum_alg": SUM_ALG,
        "sum": checksum(tensor) if crc is None else crc,
        "nbytes": len(payload),
    }
    if mac is not None:
        fields["mac"] = mac.alg
    header = json.dumps(fields).encode()
    head = _HEAD.pack(_MAGIC, len(header))
    if mac is None:
        return b"".join((head, header, payload))
    return b"".join((head, header, payload, mac.tag(head, header, payload)))


def max_record_bytes(payload_bytes: int) -> int:
    """The largest record of a layer chunk of ``payload_bytes``: what a tier read may return."""
    return _HEAD.size + MAX_HEADER_BYTES + payload_bytes + TAG_BYTES


def decode(
    record: bytes | bytearray | memoryview, expected: Expected, verify: bool = True, mac: Mac | None = None
) -> tuple[torch.Tensor, int]:
    """Parse a record and check it against ``expected``; returns (tensor, checksum).

    With ``mac``, the record's tag is checked first (a record without a valid tag is an
    IntegrityError, whoever wrote it), and then the checksum pass is skipped: the tag
    already covers every byte.

    Raises IntegrityError on any mismatch, and on anything malformed: records come from a
    shared tier that others can write to, so no content of one may raise anything else
    (it would reach vLLM's forward). The tensor aliases ``record`` (no copy).
    """
    try:
        return _decode(record, expected, verify, mac)
    except IntegrityError:
        raise
    except Exception as exc:  # a malformed record is a miss, whatever the parser tripped on
        raise IntegrityError(f"malformed record: {type(exc).__name__}: {exc}") from exc


def _decode(
    record: bytes | bytearray | memoryview, expected: Expected, verify: bool, mac: Mac | None
) -> tuple[torch.Tensor, int]:
    view = memoryview(record).cast("B")
    if mac is not None:
        # Authenticate before parsing: nothing of a record without the key's tag is read.
        if len(view) < TAG_BYTES or not hmac.compare_digest(
            mac.tag(view[:-TAG_BYTES]), bytes(view[-TAG_BYTES:])
        ):
            raise IntegrityError("MAC mismatch: record not written with this key")
    if len(view) < _HEAD.size:
        raise IntegrityError("record too short")
    magic, header_len = _HEAD.unpack_from(view)
    if magic != _MAGIC:
        raise IntegrityError("bad magic")
    if header_len > MAX_HEADER_BYTES:
        raise IntegrityError(f"header of {header_len} bytes (at most {MAX_HEADER_BYTES})")
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
    tagged = header.get("mac")
    if mac is not None and tagged != mac.alg:
        raise IntegrityError("record not tagged with this MAC")
    end = len(view) - (TAG_BYTES if tagged else 0)
    payload = view[_HEAD.size + header_len : max(_HEAD.size + header_len, end)]
    if len(payload) != nbytes or header.get("nbytes") != nbytes:
        raise IntegrityError("payload size mismatch")
    alg = header.get("sum_alg")
    crc = header.get("sum")
    if alg not in ("xxh3_64", "crc32") or type(crc) is not int or not 0 <= crc < 1 << 64:
        raise IntegrityError("bad checksum fields")
    with warnings.catch_warnings():
        # Read-only buffers (bytes from Redis) are fine: we only copy out of them.
        warnings.simplefilter("ignore", UserWarning)
        tensor = (
            torch.frombuffer(payload, dtype=expected.dtype).view(expected.shape)
            if len(payload)
            else (torch.empty(expected.shape, dtype=expected.dtype))
        )
    if verify and mac is None and _sum(alg, payload) != crc:
        raise IntegrityError("checksum mismatch")
    if alg != SUM_ALG:  # callers keep the value as an L1 check value: give them ours
        crc = checksum(tensor)
    return tensor, crc


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())
