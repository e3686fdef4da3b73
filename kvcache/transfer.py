"""Moving blocks between vLLM's paged KV tensors and host memory.

vLLM gives one tensor per layer whose block axis differs by backend: CPU_ATTN is
``[num_blocks, kv_heads, block_size, 2*head_dim]`` (axis 0), FlashAttention is
``[2, num_blocks, block_size, kv_heads, head_dim]`` (axis 1). ``PagedLayout`` finds the
axis once; host copies are always ``[n_blocks, *block_shape]`` contiguous.

On CPU there is no copy engine to overlap with: copies run on the calling thread, and
runs of consecutive blocks (consecutive in the paged tensor and in the host slab) move as
one slice copy, so the usual case is one ``copy_`` per layer.

On CUDA, copies run on side streams into pinned host memory and are ordered by events,
so a save of layer N overlaps the compute of layer N+1 and a load never blocks the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PagedLayout:
    block_dim: int
    block_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def detect(cls, kv: torch.Tensor, num_blocks: int) -> PagedLayout:
        dims = [d for d, size in enumerate(kv.shape) if size == num_blocks]
        if not dims:
            raise ValueError(f"no axis of size num_blocks={num_blocks} in KV shape {tuple(kv.shape)}")
        # A leading K/V axis of size 2 comes first on GPU layouts; prefer the later match
        # only when the first one is that K/V axis.
        dim = dims[1] if len(dims) > 1 and dims[0] == 0 and kv.shape[0] == 2 else dims[0]
        shape = tuple(s for d, s in enumerate(kv.shape) if d != dim)
        return cls(dim, shape, kv.dtype, kv.device)

    def chunk_shape(self, n_blocks: int) -> tuple[int, ...]:
        return (n_blocks, *self.block_shape)

    def describe(self) -> str:
        return f"dim{self.block_dim}:{'x'.join(map(str, self.block_shape))}:{self.dtype}"


# One block move: (host rows tensor, host row, block id in the paged tensor).
Move = tuple[torch.Tensor, int, int]


def coalesce(moves: list[Move]) -> list[tuple[torch.Tensor, int, int, int]]:
    """Group moves into runs (host rows, first host row, first block, length) where both the
    host rows and the block ids are consecutive."""
    runs: list[tuple[torch.Tensor, int, int, int]] = []
    for host, row, block in sorted(moves, key=lambda m: (id(m[0]), m[1])):
        if runs:
            h, r, b, n = runs[-1]
            if h is host and row == r + n and block == b + n:
                runs[-1] = (h, r, b, n + 1)
                continue
        runs.append((host, row, block, 1))
    return runs


class HostCopier:
    """Synchronous copies (CPU tensors, or any device when no stream is wanted)."""

    pinned = False
    # Copies on a device stream, done when their event is (CudaCopier): the jobs then issue
    # them from the load and save threads and wait on events (transfer_jobs.py).
    asynchronous = False

    def gather_rows(self, kv: torch.Tensor, layout: PagedLayout, moves: list[Move]) -> None:
        """Copy blocks of ``kv`` into host rows, one slice copy per run."""
        for host, row, block, n in coalesce(moves):
            src = kv.narrow(layout.block_dim, block, n)
            if layout.block_dim:
                src = src.movedim(layout.block_dim, 0)
            host.narrow(0, row, n).copy_(src)

    def scatter_rows(self, kv: torch.Tensor, layout: PagedLayout, moves: list[Move]) -> None:
        """Copy host rows into blocks of ``kv``, one slice copy per run."""
        for host, row, block, n in coalesce(moves):
            dst = kv.narrow(layout.block_dim, block, n)
            if layout.block_dim:
                dst = dst.movedim(layout.block_dim, 0)
            dst.copy_(host.narrow(0, row, n))

    def mark_compute(self) -> Any:
        return None

    def after(self, event: Any) -> Any:
        """Record completion of work issued so far by this thread (an event on CUDA)."""
        return None

    def wait_device(self, event: Any) -> None:
        """Make the compute stream wait for ``event`` (no host block)."""

    def wait_host(self, event: Any) -> None:
        """Block the host until ``event`` completes."""


class CudaCopier(HostCopier):
    """Side-stream copies through pinned host memory, ordered by CUDA events."""

    pinned = True
    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.load_stream = torch.cuda.Stream(device=device)
        self.save_stream = torch.cuda.Stream(device=device)

    def mark_compute(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def device_ids(self, block_ids: list[int], save: bool) -> torch.Tensor:
        """Block ids on the device, uploaded on the save (or load) stream: a step's ids are
        the same for every layer, so a job uploads them once, not once per layer."""
        with torch.cuda.stream(self.save_stream if save else self.load_stream):
            return torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)

    def gather_async(
        self,
        kv: torch.Tensor,
        layout: PagedLayout,
        block_ids: list[int] | torch.Tensor,
        ready: torch.cuda.Event,
        host: torch.Tensor,
    ) -> torch.cuda.Event:
        """Copy blocks into ``host`` (pinned slab rows) once ``ready`` (this layer's compute)
        has happened. ``block_ids``: a list, or ``device_ids(..., save=True)``."""
        with torch.cuda.stream(self.save_stream):
            self.save_stream.wait_event(ready)
            ids = block_ids if isinstance(block_ids, torch.Tensor) else self.device_ids(block_ids, save=True)
            dev = kv.index_select(layout.block_dim, ids)
            if layout.block_dim:
                dev = dev.movedim(layout.block_dim, 0)
            host.copy_(dev.contiguous(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.save_stream)
        return done

    def scatter_async(
        self,
        kv: torch.Tensor,
        layout: PagedLayout,
        block_ids: list[int] | torch.Tensor,
        src: torch.Tensor,
        ready: torch.cuda.Event | None,
    ) -> torch.cuda.Event:
        """Copy host rows ``src`` into blocks of ``kv`` after ``ready``. ``block_ids``: a
        list, or ``device_ids(..., save=False)``."""
        with torch.cuda.stream(self.load_stream):
            if ready is not None:
                # Blocks may have been freed and reused: write only after earlier work on them.
                self.load_stream.wait_event(ready)
            if not src.is_pinned():
                src = src.pin_memory()
            ids = block_ids if isinstance(block_ids, torch.Tensor) else self.device_ids(block_ids, save=False)
            dev = src.to(kv.device, non_blocking=True)
            if layout.block_dim:
                dev = dev.movedim(0, layout.block_dim)
            kv.index_copy_(layout.block_dim, ids, dev)
            done = torch.cuda.Event()
            done.record(self.load_stream)
        return done

    def wait_device(self, event: Any) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def wait_host(self, event: Any) -> None:
        if event is not None:
            event.synchronize()


def make_copier(device: torch.device) -> HostCopier:
    return CudaCopier(device) if device.type == "cuda" else HostCopier()
