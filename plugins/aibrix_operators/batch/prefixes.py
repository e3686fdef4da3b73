"""Prefix signatures: which requests of a batch share a leading prompt, and the order that groups them.

Validation calls ``PrefixSignatures.add`` once per request line (in its hot loop, so the
work is a few C calls): from the line's raw bytes, starting at the ``"messages"`` key (chat),
``"prompt"`` (completions) or ``"input"`` (embeddings), it hashes the first 256, 1024, 4096
and 16384 bytes, chained, so each byte is hashed once. Requests whose JSON text agrees on the
first L bytes of that array share the rendered prompt (chat template + system + earlier turns
+ the start of the last turn) to about the same depth, which is what vLLM's prefix cache
reuses; the several lengths let partial sharing count (one few-shot template, different
questions). No tokenizer: byte prefixes find the same groups without one, and tokenizing
~1 KB costs ~50 µs of Python per request — more than validating it (docs/prefix-batching.md).

The hashes are Python's ``hash()`` (SipHash, 64-bit, seeded per process). They never leave
the validating process: ``grouping_order`` turns them into an order of line numbers, which is
what the split step reads. A collision merges two groups, which changes only the order in
which requests are sent, never a result.

Memory: 8 bytes for the line's offset, 1 for how deep its prompt goes and 8 per level it
reaches: 9 bytes per request of short prompts (9 MB for 1M lines), 41 for long ones, plus numpy
temporaries of a few arrays of that length at the end, one level at a time. So grouping has a
ceiling, ``MAX_GROUPED_REQUESTS``: past it the signatures are dropped and the batch is sent in
file order (docs/prefix-batching.md), and validation's memory stays flat however long the file.
"""

from __future__ import annotations

import io
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from aibrix_operators.storage import Storage

# Byte lengths of the rendered prefix that are hashed: a prefix shared to any of these depths
# counts. Powers of four keep the levels few (each costs 8 bytes per request and one sort).
LEVELS: tuple[int, ...] = (256, 1024, 4096, 16384)
# Batches of more requests are not grouped: at 9-41 bytes per request and a sort of several such
# arrays, 10,000,000 requests would cost the validating worker 300 MB and more. A batch that
# large fills every server's queue on its own, so the order within it buys little.
MAX_GROUPED_REQUESTS = 2_000_000


def prompt_start(raw: bytes) -> int:
    """Where a request line's prompt starts (its ``messages``, ``prompt`` or ``input`` key), or -1:
    prefix hashes cover the line's bytes from there on."""
    s = raw.find(b'"messages"')
    if s < 0:
        s = raw.find(b'"prompt"')
        if s < 0:
            s = raw.find(b'"input"')
    return s


def prefix_hashes(raw: bytes) -> tuple[int, ...]:
    """The chained prefix hashes of one request line, exactly as ``PrefixSignatures.add``
    computes them (0 where the prompt is shorter than the level): the driver's warm-up gate
    matches requests by them."""
    s = prompt_start(raw)
    n = len(raw) - s if s >= 0 else 0
    out = []
    h: Any = None
    prev_len = 0
    for length in LEVELS:
        if n < length:
            break
        block = raw[s + prev_len : s + length]
        h = (hash((h, block)) if prev_len else hash(block)) or 1
        out.append(h)
        prev_len = length
    return tuple(out) + (0,) * (len(LEVELS) - len(out))


class PrefixSignatures:
    """Per-request prefix hashes and line offsets, collected while validation streams the file.

    ``add`` runs once per request line inside validation's hot loop, so it is written for
    speed (~1 µs on a 1 KB line), the levels unrolled. A request keeps one byte (how many
    levels its prompt reaches) and a hash for each level it reaches, nothing for the others:
    a batch of short prompts, the common case, costs 1 byte per request here, not 32.
    """

    levels = LEVELS

    def __init__(self, max_requests: int | None = MAX_GROUPED_REQUESTS) -> None:
        # None: no ceiling (a batch naming LoRA adapters must be ordered by model, whatever its size).
        self.limit = max_requests if max_requests is not None else 2**63
        self.dropped_at: int | None = None  # the ceiling, once the batch went past it
        self._depth = bytearray()
        # Level k's hashes of the requests whose prompts reach it, in input order.
        self._h1, self._h2, self._h3, self._h4 = (array("q") for _ in LEVELS)
        self.offsets = array("q")
        # Where the last request line ends (the file may go on with trailing blank lines).
        self.end = 0

    def __len__(self) -> int:
        return len(self.offsets)

    def add(self, raw: bytes, offset: int) -> None:
        """Record the request line ``raw`` that starts at byte ``offset`` of the file."""
        if len(self.offsets) >= self.limit:
            if self.dropped_at is None:
                self._drop()
            return
        self.offsets.append(offset)
        self.end = offset + len(raw)
        s = prompt_start(raw)
        n = len(raw) - s if s >= 0 else 0
        # Chained: each level's hash covers every byte up to its length.
        if n < 256:
            self._depth.append(0)
            return
        h1 = hash(raw[s:s + 256]) or 1  # 0 means "not this long"
        self._h1.append(h1)
        if n < 1024:
            self._depth.append(1)
            return
        h2 = hash((h1, raw[s + 256:s + 1024])) or 1
        self._h2.append(h2)
        if n < 4096:
            self._depth.append(2)
            return
        self._h3.append(h3 := hash((h2, raw[s + 1024:s + 4096])) or 1)
        if n < 16384:
            self._depth.append(3)
            return
        self._h4.append(hash((h3, raw[s + 4096:s + 16384])) or 1)
        self._depth.append(4)

    def _drop(self) -> None:
        """Past the ceiling: free what was collected and collect nothing more (``len`` is 0 from
        now on, so the batch keeps its file order)."""
        self.dropped_at = len(self.offsets)
        self.limit = -1
        self._depth = bytearray()
        self._h1, self._h2, self._h3, self._h4 = (array("q") for _ in LEVELS)
        self.offsets = array("q")

    def columns(self) -> Iterator[np.ndarray]:
        """Level by level, every request's hash (0 where its prompt is shorter than the level),
        one column at a time; it stops at the first level no prompt reaches."""
        depth = np.frombuffer(self._depth, dtype=np.uint8)
        for k, hashes in enumerate((self._h1, self._h2, self._h3, self._h4)):
            if not len(hashes):
                return
            column = np.zeros(len(depth), dtype=np.int64)
            column[depth > k] = np.frombuffer(hashes, dtype=np.int64)
            yield column


assert len(LEVELS) == 4 and LEVELS == (256, 1024, 4096, 16384), "PrefixSignatures.add unrolls LEVELS"


@dataclass(frozen=True)
class PrefixGrouping:
    """The send order that puts requests with a shared prefix back to back, and what it found.

    Where nothing is to be reordered (no prompt shares a prefix, no adapter is named: the common
    batch, sent in file order), ``order`` and ``offsets`` are built only if asked for, from the
    signatures' own offsets: validation's memory peak at 1,000,000 requests was these two arrays
    and the grouping's work arrays, ~25 MB made for a batch that then never used them
    (bench/dag_at_scale.py).
    """

    # 0-based request indices (line number - 1) in send order; None: file order.
    sorted_order: np.ndarray | None
    # The byte offset of every request line plus the end of the last, or, not built yet, the
    # signatures' line offsets (int64) and the end.
    line_offsets: np.ndarray | tuple[array, int]
    shared_requests: int       # requests that share a prefix of >= LEVELS[0] bytes with another
    groups: int                # distinct shared prefixes at the deepest level each request shares
    # The model of every request in input order (0 the base, k the k-th LoRA adapter), when the
    # batch names adapters: split cuts shards where the model changes.
    models: np.ndarray | None = None

    @property
    def order(self) -> np.ndarray:
        """0-based request indices (line number - 1), in send order."""
        if self.sorted_order is not None:
            return self.sorted_order
        starts = self.line_offsets
        return np.arange(len(starts[0]) if isinstance(starts, tuple) else len(starts) - 1, dtype=np.int64)

    @property
    def offsets(self) -> np.ndarray:
        """The byte offset of every request line, plus the end of the last."""
        if not isinstance(self.line_offsets, tuple):
            return self.line_offsets
        return _offsets_with_end(*self.line_offsets)

    @property
    def reorders(self) -> bool:
        order = self.sorted_order
        return order is not None and bool(len(order)) and not bool(np.all(order[1:] > order[:-1]))


def _offsets_with_end(starts: array, end: int) -> np.ndarray:
    return np.append(np.frombuffer(starts, dtype=np.int64) if len(starts) else np.zeros(0, np.int64),
                     np.int64(end))


def grouping_order(
    signatures: PrefixSignatures, models: np.ndarray | None = None, by_prefix: bool = True
) -> PrefixGrouping:
    """Sort requests by (model, group of level 1, group of level 2, ..., line), groups ranked by
    first line.

    ``models`` (one small integer per request: 0 the base model, k a LoRA adapter) puts each
    adapter's requests back to back, so the server keeps one adapter's weights hot while they
    run (docs/lora.md); ``by_prefix=False`` orders by model only.
    A request's group at a level is the first line holding the same prefix hash, or its own line
    when no other request shares it there: so every shared prefix is contiguous, sub-prefixes
    are contiguous inside it, and the first request of each group comes first. Ties keep input
    order. This is a sort of 8-byte keys (``np.lexsort``), never of the file's lines.
    """
    n = len(signatures)
    keys: list[np.ndarray] = []
    if models is not None and n and models.any():
        _, first_line = np.unique(models, return_index=True)
        # Models ranked by their first request, so the base is not forced ahead of the adapters.
        rank = np.empty(int(models.max()) + 1, dtype=np.int64)
        rank[np.unique(models)] = np.argsort(np.argsort(first_line))
        keys.append(rank[models])
    # The per-request work arrays are made at the first level that has a shared prefix: most
    # batches have none, and they would be validation's memory peak (class docstring).
    idx = shared_any = deepest = None
    # columns() stops at the first level no prompt reaches (the levels only grow).
    for column in signatures.columns() if by_prefix else ():
        if not _repeats(column):
            # Deeper levels extend these prefixes (the hashes are chained), so they share
            # nothing either. Asked with one in-place sort, not np.unique's index arrays: for a
            # batch of unique prompts this is the validate step's memory peak (~30 MB per 1M).
            break
        if idx is None or shared_any is None or deepest is None:
            idx = np.arange(n, dtype=np.int64)
            shared_any = np.zeros(n, dtype=bool)
            deepest = np.full(n, -1, dtype=np.int64)  # the group each request shares at its deepest level
        _, first, inverse, counts = np.unique(
            column, return_index=True, return_inverse=True, return_counts=True
        )
        shared = (counts[inverse] > 1) & (column != 0)
        group = np.where(shared, first[inverse], idx)
        keys.append(group)
        shared_any |= shared
        deepest = np.where(shared, group, deepest)
        del first, inverse, counts, shared
    with_models = models if models is not None and n and models.any() else None
    if not keys:
        return PrefixGrouping(None, (signatures.offsets, signatures.end), 0, 0, with_models)
    offsets = _offsets_with_end(signatures.offsets, signatures.end)
    # np.lexsort sorts by the last key first.
    order = np.lexsort((np.arange(n, dtype=np.int64) if idx is None else idx, *reversed(keys)))
    groups = 0 if deepest is None else len(np.unique(deepest[deepest >= 0]))
    shared_requests = 0 if shared_any is None else int(shared_any.sum())
    return PrefixGrouping(order.astype(np.int64), offsets, shared_requests, groups, with_models)


def _repeats(column: np.ndarray) -> bool:
    """Whether two requests have the same non-zero hash in this column."""
    present = column[column != 0]  # a copy, sorted in place
    present.sort()
    return bool(len(present) > 1 and (present[1:] == present[:-1]).any())


def worth_grouping(grouping: PrefixGrouping) -> bool:
    """``auto``'s rule: reorder only if it changes the order and there are two shared prefixes or more.

    One prefix common to the whole file (a single system prompt) stays in any server's cache
    in input order; reordering would only cost the split and merge their extra work.
    """
    return grouping.models is not None or (grouping.groups >= 2 and grouping.reorders)


# --------------------------------------------------------------------------- the order file
# Written by validate beside the run's work files and read by split: .npy arrays, the order
# (int64 request indices) and the offsets (int64, one more than requests), 16 bytes per request;
# then, for a batch that names LoRA adapters, the model of each request (uint16, input order).


def write_order(storage: Storage, uri: str, grouping: PrefixGrouping) -> None:
    buf = io.BytesIO()
    np.save(buf, grouping.order, allow_pickle=False)
    np.save(buf, grouping.offsets, allow_pickle=False)
    if grouping.models is not None:
        np.save(buf, grouping.models.astype(np.uint16), allow_pickle=False)
    storage.write_bytes(uri, buf.getvalue())


def read_order(storage: Storage, uri: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The order, the offsets, and the per-request models (None: one model)."""
    data = storage.read_bytes(uri)
    buf = io.BytesIO(data)
    order = np.load(buf, allow_pickle=False)
    offsets = np.load(buf, allow_pickle=False)
    models = np.load(buf, allow_pickle=False) if buf.tell() < len(data) else None
    if len(offsets) != len(order) + 1:
        raise ValueError(f"{uri}: {len(order)} requests but {len(offsets)} offsets")
    if models is not None and len(models) != len(order):
        raise ValueError(f"{uri}: {len(order)} requests but {len(models)} models")
    return order, offsets, models
