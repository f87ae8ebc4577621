"""The `vmm` arena backend: one address reservation for the whole plan, physical memory mapped
only under live units.

allocate() reserves the plan's address space (each buffer from a chunk boundary, see
kvatlas.vmm.layout), maps the chunks that must exist from the start (null units, block tables,
workspace: the arena zeroes them) and returns every buffer as a view of ONE tensor over the
reservation, created once. From then on the allocator drives it through allocator_hooks():
acquire() before handing out units (maps what is missing, refuses over max_physical_bytes or on
device out-of-memory with nothing changed), release() when units die (unmaps empty chunks, with
hysteresis). Ledger measures come from counters: reserved = the reservation, physical = mapped
chunks × chunk bytes, tensor = the buffers' logical bytes.

chunk_bytes (default: 4 × the driver's granularity, 8 MiB on an H200) is the unit of everything
above: the layout's chunks, and each map (one physical allocation of chunk_bytes per chunk, one
cuMemCreate + cuMemMap + cuMemSetAccess). A power of two and a multiple of the granularity.
Larger chunks map fewer times as a workload grows (8 MiB: a quarter of the calls) and back
memory more coarsely (more physical bytes around the live data, more tail per buffer).
Measured on an H200 (bench/RESULTS.md): a growing decode step for 1,024 requests cost 1.113×
the plain backend with 2 MiB chunks and 1.063× with 8 MiB, while a V4-Flash plan for 120 GiB at
10% occupancy held 10.18% vs 10.20% of the plain backend's memory: 4 granules is the default.

Views stay valid only while the backend lives: release() unmaps everything and frees the
address range, so a tensor kept past KVCache.close() points at nothing (a GPU fault, not a
silent read).
"""

from __future__ import annotations

import numpy as np

from ..cache.arena import Backend
from ..errors import ConfigError
from ..units import fmt_bytes, parse_bytes
from .chunks import ChunkMap
from .layout import ChunkLayout


GRANULES_PER_CHUNK = 4   # default chunk: 4 × the driver's granularity (measured, see above)


class VmmBackend(Backend):
    name = "vmm"
    commits_upfront = False   # the arena must not demand the whole plan be free up front

    def __init__(self, driver=None, *, max_physical_bytes: int | str | None = None,
                 keep_empty_chunks: int = 32, chunk_bytes: int | str | None = None) -> None:
        if not isinstance(keep_empty_chunks, int) or isinstance(keep_empty_chunks, bool) or keep_empty_chunks < 0:
            raise ConfigError("keep_empty_chunks", f"{keep_empty_chunks!r} is not an integer ≥ 0",
                              "give how many empty chunks may stay mapped (0 unmaps at once)")
        self.driver = driver
        self.max_physical_bytes = (None if max_physical_bytes is None
                                   else parse_bytes(max_physical_bytes, "max_physical_bytes"))
        self.keep_empty_chunks = keep_empty_chunks
        self.chunk_bytes = None if chunk_bytes is None else parse_bytes(chunk_bytes, "chunk_bytes")
        if self.chunk_bytes is not None and (self.chunk_bytes <= 0 or self.chunk_bytes & (self.chunk_bytes - 1)):
            raise ConfigError("chunk_bytes", f"{chunk_bytes!r} is not a power of two",
                              "give a power-of-two multiple of the device's granularity, e.g. 2MiB or 8MiB")
        self.layout: ChunkLayout | None = None
        self.chunks: ChunkMap | None = None
        self.base = None
        self._tensor = 0

    # ---------------------------------------------------------------- Backend
    def allocate(self, plan, device) -> dict[str, object]:
        import torch
        device = torch.device(device)
        if self.driver is None:
            from .driver import CudaDriver
            self.driver = CudaDriver(device)   # raises ConfigError without CUDA / cuda-python
        elif device.type != "cpu":
            raise ConfigError("backend", f"the {self.driver.label} driver backs CPU tensors only; device is {device}",
                              "use device='cpu' with the stand-in, or no driver argument on CUDA")
        g = self.driver.granularity
        chunk = GRANULES_PER_CHUNK * g if self.chunk_bytes is None else self.chunk_bytes
        if chunk % g:
            raise ConfigError("chunk_bytes", f"{chunk} B ({fmt_bytes(chunk)}) is not a multiple of the "
                              f"{self.driver.label} driver's granularity, {g} B ({fmt_bytes(g)})",
                              f"give a power-of-two multiple of {fmt_bytes(g)}")
        self.layout = ChunkLayout(plan.buffers, chunk)
        self.chunks = ChunkMap(self.layout, self.driver, keep_empty_chunks=self.keep_empty_chunks,
                               max_physical_bytes=self.max_physical_bytes)
        pinned = np.union1d(self.layout.pinned_chunks(), [0]).astype(np.int64)  # chunk 0: torch reads
        self._check_cap(len(pinned) * self.layout.granularity)               # the base pointer's device
        self.driver.reserve(self.layout.reserved_bytes)
        try:
            self.chunks.pin(pinned)
            self.base = self.driver.tensor()
        except BaseException:
            self.driver.close()
            raise
        self._tensor = sum(p.spec.bytes for p in self.layout.placed)
        return {p.spec.name: self.base.narrow(0, p.offset_bytes, p.spec.bytes) for p in self.layout.placed}

    def _check_cap(self, pinned_bytes: int) -> None:
        cap = self.max_physical_bytes
        if cap is not None and pinned_bytes > cap:
            raise ConfigError("max_physical_bytes", f"{cap} B ({fmt_bytes(cap)}) is below the {pinned_bytes} B "
                              "the null units, block tables and workspace keep mapped",
                              f"give at least {fmt_bytes(pinned_bytes)}")

    @property
    def tensor_bytes(self) -> int:
        return self._tensor

    @property
    def reserved_bytes(self) -> int:
        return self.layout.reserved_bytes if self.layout is not None else 0

    @property
    def physical_bytes(self) -> int:
        return self.chunks.physical_bytes if self.chunks is not None else 0

    def buffer_backing(self, buffer: str, tensor_bytes: int) -> tuple[int, int]:
        p = self.layout.by_name[buffer]
        return p.num_chunks << self.layout.shift, int(self.chunks.mapped_per_buffer[p.index]) << self.layout.shift

    def allocator_hooks(self):
        return self.chunks

    def trim(self) -> int:
        """Unmap every chunk that holds nothing live now; returns the bytes given back."""
        return self.chunks.trim() if self.chunks is not None else 0

    def release(self) -> None:
        self.base = None
        if self.driver is not None and self.layout is not None:
            self.driver.close()
        self.layout = self.chunks = None
        self._tensor = 0

