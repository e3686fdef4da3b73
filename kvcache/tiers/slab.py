"""Preallocated host memory for L1: fixed-size slots, one per stored chunk.

Every chunk of one connector has the same size (all layers x ``chunk_blocks`` blocks), so
L1 needs no general allocator: memory is a few large segments cut into slots, and a slot
freed by eviction is reused by the next save. Saves copy straight into warm memory
(no allocation, no page faults after the first use, no ``free`` on eviction) and on a GPU
the segments are pinned once, not per copy.

Layout of a segment: ``[n_layers, slots * chunk_blocks, *block_shape]``, so a slot's rows
of one layer are contiguous, and consecutive slots are contiguous too: the chunks of one
prompt saved together usually land in consecutive slots and load back with one copy per
layer.

Slots are reference counted. L1's index holds one reference; a load in flight and a
queued L2 write each hold one more, so a slot evicted from the index is reused only once
nobody reads it. Each slot also records its owner (the chunk key) so that a reader can
check that the bytes it is about to use still belong to the chunk it asked for.
"""

from __future__ import annotations

import heapq
import math
import threading

import numpy as np
import torch

from kvcache.host_copy import host_array


class SlabPool:
    """Thread-safe pool of equal host slots holding ``n_layers x chunk_blocks`` blocks each."""

    def __init__(
        self,
        capacity_bytes: int,
        n_layers: int,
        chunk_blocks: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        pin_memory: bool = False,
        segment_bytes: int = 256 << 20,
    ) -> None:
        self.n_layers = n_layers
        self.chunk_blocks = chunk_blocks
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.pin_memory = pin_memory
        elem = torch.empty((), dtype=dtype).element_size()
        self.block_bytes = math.prod(block_shape) * elem
        self.slot_bytes = n_layers * chunk_blocks * self.block_bytes
        self.max_slots = capacity_bytes // self.slot_bytes if self.slot_bytes else 0
        self.slots_per_segment = max(1, min(self.max_slots, segment_bytes // max(1, self.slot_bytes)))
        self.segments: list[torch.Tensor] = []
        # segment -> layer -> that layer's rows: the same tensor object on every call, so
        # copies can tell that two slots' rows lie in one tensor and merge them.
        self._layer_rows: list[list[torch.Tensor]] = []
        self._layer_arrays: list[list[np.ndarray]] = []  # the same rows as numpy byte views
        self._free: list[int] = []  # a heap: lowest slot first keeps a prompt's chunks adjacent
        self._refs: list[int] = []
        self._owner: list[str | None] = []
        self._lock = threading.Lock()

    # -- allocation --------------------------------------------------------------------
    def alloc(self, owner: str) -> int | None:
        """A free slot (one reference, owned by ``owner``), or None when all are in use."""
        with self._lock:
            if not self._free:
                self._grow()
            if not self._free:
                return None
            slot = heapq.heappop(self._free)
            self._refs[slot] = 1
            self._owner[slot] = owner
            return slot

    def ref(self, slot: int) -> None:
        with self._lock:
            assert self._refs[slot] > 0, "ref of a free slot"
            self._refs[slot] += 1

    def unref(self, slot: int) -> None:
        with self._lock:
            assert self._refs[slot] > 0, "unref of a free slot"
            self._refs[slot] -= 1
            if self._refs[slot] == 0:
                self._owner[slot] = None
                heapq.heappush(self._free, slot)

    def owner(self, slot: int) -> str | None:
        return self._owner[slot]

    @property
    def slots_in_use(self) -> int:
        with self._lock:
            return len(self._refs) - len(self._free)

    @property
    def bytes_reserved(self) -> int:
        """Host memory held by the segments (never more than the capacity)."""
        return len(self._refs) * self.slot_bytes

    def _grow(self) -> None:
        have = len(self._refs)
        n = min(self.slots_per_segment, self.max_slots - have)
        if n <= 0:
            return
        # Segments are first needed inside vLLM's forward (inference mode), but load
        # threads write into them too: they must be normal tensors, not inference tensors.
        with torch.inference_mode(False):
            seg = torch.empty(
                (self.n_layers, n * self.chunk_blocks, *self.block_shape),
                dtype=self.dtype,
                pin_memory=self.pin_memory,
            )
            self._layer_rows.append(list(seg.unbind(0)))
            self._layer_arrays.append([host_array(rows) for rows in self._layer_rows[-1]])
        self.segments.append(seg)
        self._refs.extend([0] * n)
        self._owner.extend([None] * n)
        for s in range(have, have + n):
            heapq.heappush(self._free, s)

    # -- addressing --------------------------------------------------------------------
    def rows(self, slot: int, layer: int) -> tuple[torch.Tensor, int]:
        """(the segment's rows of ``layer``, first row of ``slot``): for run-coalesced copies."""
        seg, local = divmod(slot, self.slots_per_segment)
        return self._layer_rows[seg][layer], local * self.chunk_blocks

    def row_bytes(self, slot: int, layer: int) -> tuple[np.ndarray, int]:
        """``rows`` as a numpy view of bytes (made once per segment: slicing it is ~10x
        cheaper than a torch ``narrow``, and CPU chunk copies make one per chunk)."""
        seg, local = divmod(slot, self.slots_per_segment)
        return self._layer_arrays[seg][layer], local * self.chunk_blocks

    def segment_of(self, slot: int) -> int:
        return slot // self.slots_per_segment

    def view(self, slot: int, layer: int) -> torch.Tensor:
        """``[chunk_blocks, *block_shape]``: the slot's blocks of one layer (contiguous)."""
        base, row = self.rows(slot, layer)
        return base.narrow(0, row, self.chunk_blocks)
