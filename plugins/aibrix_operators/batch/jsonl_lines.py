"""Reading a JSONL stream that may be hostile, a line at a time, with bounded memory: an
over-long line is measured and skipped, never buffered; a run of bare newlines is consumed a
buffer at a time (``validation.py`` reports what it finds)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import BinaryIO

SKIP_CHUNK = 1 << 20
UTF8_BOM = b"\xef\xbb\xbf"  # a file saved with one: reported on line 1, skipped when reading ids back


def skip_rest_of_line(readline: Callable[[int], bytes], size: int) -> int:
    """Read past the rest of an over-long line without buffering it; its total size."""
    while True:
        rest = readline(SKIP_CHUNK)
        size += len(rest)
        if not rest or rest.endswith(b"\n"):
            return size


def read_lines(stream: BinaryIO, max_line: int) -> Iterator[tuple[bytes, bool, int]]:
    """Yield ``(line, too_long, size)``; an over-long line is skipped, not buffered."""
    readline = stream.readline
    limit = max_line + 2  # room for "\r\n" after a line of exactly max_line bytes
    while True:
        line = readline(limit)
        if not line:
            return
        if len(line) == limit and not line.endswith(b"\n"):
            yield b"", True, skip_rest_of_line(readline, len(line))
        elif len(line.rstrip(b"\r\n")) > max_line:
            # Fits the read limit only thanks to the room left for "\r\n": still too long.
            yield b"", True, len(line)
        else:
            yield line, False, len(line)


def skip_newlines(stream: BinaryIO, peek: Callable[[int], bytes]) -> int:
    """Consume the bare ``\n`` bytes at the stream's position, a buffer at a time; how many."""
    skipped = 0
    while True:
        buf = peek(SKIP_CHUNK)
        n = len(buf) - len(buf.lstrip(b"\n"))
        if n == 0:
            return skipped
        stream.read(n)
        skipped += n
