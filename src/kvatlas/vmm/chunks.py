"""Chunk bookkeeping: which chunks are mapped, how many live units each holds, when to unmap.

Independent of CUDA: it drives any kvatlas.vmm.driver.Driver. The allocator tells it which unit
ids of which index space go live (acquire) and die (release); it keeps, per chunk, the count of
live units touching it (`refs`). Invariants (checked by `problems()`):
  - a chunk with refs > 0 is mapped (a live page is always backed);
  - a chunk is unmapped only when refs == 0;
  - physical bytes == mapped chunks × granularity, and ≤ max_physical_bytes when set.

Hysteresis: a chunk whose last live unit goes is not unmapped at once but kept ("retained") in
a FIFO of up to `keep_empty_chunks`; the oldest goes first. A decode batch whose pages cross a
chunk boundary back and forth would otherwise map and unmap the same chunk every few steps.
`trim()` unmaps every retained chunk now. Retained chunks count as physical (they are), and are
given up first when the physical cap or the device needs room.

acquire() is all-or-nothing: the cap is checked before anything changes, and if the device runs
out of memory midway, the chunks this call mapped are unmapped again and the call raises
PoolExhaustedError("physical"); refs, the live set and the caller's state stay as they were
(only retained-empty chunks may have been given back to make room).
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import PoolExhaustedError
from ..units import fmt_bytes
from .driver import DeviceOutOfMemory
from .layout import ChunkLayout


class ChunkMap:
    def __init__(self, layout: ChunkLayout, driver, *, keep_empty_chunks: int = 32,
                 max_physical_bytes: int | None = None) -> None:
        self.layout, self.driver = layout, driver
        self.G, self.shift = layout.granularity, layout.shift
        self.keep = keep_empty_chunks
        self.max_chunks = None if max_physical_bytes is None else max_physical_bytes >> self.shift
        n = layout.num_chunks
        # one extra slot: the layout's sentinel, which pads its tables; it reads as mapped and
        # always live, so it never triggers a map or an unmap. `refs`/`mapped` hide it.
        self._refs = np.zeros(n + 1, np.int64)
        self._refs[n] = 1 << 40
        self._mapped = np.zeros(n + 1, bool)
        self._mapped[n] = True
        self.refs, self.mapped = self._refs[:n], self._mapped[:n]
        self.retained: dict[int, None] = {}   # mapped, refs == 0, oldest first
        self.num_mapped = self.num_live = 0
        self.mapped_per_buffer = np.zeros(len(layout.placed), np.int64)
        self.pinned = np.zeros(0, np.int64)
        self.map_calls = self.unmap_calls = 0
        self.map_seconds = 0.0

    @property
    def physical_bytes(self) -> int:
        return self.num_mapped << self.shift

    # ---------------------------------------------------------------- start
    def pin(self, chunks: np.ndarray) -> None:
        """Map chunks for the arena's whole life (null units, tables, workspace)."""
        self._map(chunks)
        self.refs[chunks] += 1
        self.num_live += len(chunks)
        self.pinned = chunks

    # ---------------------------------------------------------------- units go live
    def _chunks(self, requests) -> np.ndarray:
        parts = [self.layout.chunks_of(group, ids) for group, ids in requests if len(ids)]
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def shortfall(self, requests):
        """PoolExhaustedError if giving these units backing would pass max_physical_bytes, else None.
        requests: (group, unit ids) pairs. Changes nothing."""
        return self._cap_shortfall(self._chunks(requests))

    def _cap_shortfall(self, chunks: np.ndarray):
        if self.max_chunks is None or len(chunks) == 0:
            return None
        revive = np.unique(chunks[self._refs[chunks] == 0])
        if self.num_live + len(revive) <= self.max_chunks:
            return None
        free = max(self.max_chunks - self.num_live, 0) << self.shift
        return PoolExhaustedError("physical", len(revive) << self.shift, free, "bytes",
                                  f"max_physical_bytes={self.max_chunks << self.shift} "
                                  f"({fmt_bytes(self.max_chunks << self.shift)}) would be exceeded")

    def acquire(self, requests) -> None:
        """Back every chunk the units touch and count them live; all or nothing."""
        chunks = self._chunks(requests)
        if len(chunks) == 0:
            return
        short = self._cap_shortfall(chunks)
        if short is not None:
            raise short
        zero = self._refs[chunks] == 0
        if zero.any():    # the common decode step lands in chunks already live: skips all this
            revive = np.unique(chunks[zero])
            new = revive[~self._mapped[revive]]
            if len(new):
                self._make_room(len(new), protect=revive)
                self._map_or_refuse(new, protect=revive)
            for c in revive.tolist():
                self.retained.pop(c, None)
            self.num_live += len(revive)
        np.add.at(self._refs, chunks, 1)

    def _make_room(self, num_new: int, protect: np.ndarray) -> None:
        """Give back retained chunks so that mapping num_new more stays within the cap."""
        if self.max_chunks is None:
            return
        excess = self.num_mapped + num_new - self.max_chunks
        if excess > 0:
            self._evict(excess, protect)

    def _map_or_refuse(self, new: np.ndarray, protect: np.ndarray) -> None:
        try:
            self._map(new)
        except DeviceOutOfMemory as first:
            if not self.retained:
                raise self._oom(new, first) from None
            self._evict(len(self.retained), protect)   # the device needs memory: give back the cache
            try:
                self._map(new)
            except DeviceOutOfMemory as second:
                raise self._oom(new, second) from None

    def _oom(self, new: np.ndarray, err) -> PoolExhaustedError:
        return PoolExhaustedError("physical", len(new) << self.shift, 0, "bytes",
                                  f"the device is out of memory ({err}); nothing was mapped")

    def _map(self, chunks: np.ndarray) -> None:
        """Map each chunk; if one fails, unmap those this call mapped and re-raise."""
        done = []
        t0 = time.perf_counter()
        try:
            for c in chunks.tolist():
                self.driver.map(c << self.shift, self.G)
                done.append(c)
        except BaseException:
            for c in done:
                self.driver.unmap(c << self.shift, self.G)
            raise
        finally:
            self.map_seconds += time.perf_counter() - t0
        self.map_calls += len(done)
        self.mapped[chunks] = True
        self.num_mapped += len(chunks)
        np.add.at(self.mapped_per_buffer, self.layout.buffer_of_chunk[chunks], 1)

    # ---------------------------------------------------------------- units die
    def release(self, group: str, ids: np.ndarray) -> None:
        chunks = self.layout.chunks_of(group, ids)
        if len(chunks) == 0:
            return
        np.subtract.at(self._refs, chunks, 1)
        zero = self._refs[chunks] == 0
        if not zero.any():
            return
        dead = np.unique(chunks[zero])
        self.num_live -= len(dead)
        for c in dead.tolist():
            self.retained[c] = None
        if len(self.retained) > self.keep:
            self._evict(len(self.retained) - self.keep)

    def trim(self) -> int:
        """Unmap every chunk that holds nothing live; returns the bytes given back."""
        n = len(self.retained)
        self._evict(n)
        return n << self.shift

    def _evict(self, count: int, protect: np.ndarray | None = None) -> None:
        keep = set() if protect is None else set(protect.tolist())
        victims = [c for c in self.retained if c not in keep][:count]
        if not victims:
            return
        self.driver.quiesce()   # queued kernels may still read these chunks
        for c in victims:
            self.driver.unmap(c << self.shift, self.G)
            del self.retained[c]
        v = np.asarray(victims, np.int64)
        self.mapped[v] = False
        self.num_mapped -= len(v)
        self.unmap_calls += len(v)
        np.subtract.at(self.mapped_per_buffer, self.layout.buffer_of_chunk[v], 1)

    # ---------------------------------------------------------------- checks
    def problems(self, live_units: dict) -> list[str]:
        """Recount refs from the live unit ids of every group and compare with every counter."""
        refs = np.zeros_like(self._refs)
        np.add.at(refs, self.pinned, 1)
        for group, ids in live_units.items():
            np.add.at(refs, self.layout.chunks_of(group, ids), 1)
        refs = refs[:-1]
        out = []
        if not np.array_equal(refs, self.refs):
            out.append(f"vmm: chunk refs disagree with the live units at {np.flatnonzero(refs != self.refs)[:8]}")
        if np.any((self.refs > 0) & ~self.mapped):
            out.append(f"vmm: live chunks unmapped: {np.flatnonzero((self.refs > 0) & ~self.mapped)[:8]}")
        empty = set(np.flatnonzero(self.mapped & (self.refs == 0)).tolist())
        if empty != set(self.retained) or len(self.retained) > self.keep:
            out.append(f"vmm: {len(empty)} empty mapped chunks, {len(self.retained)} retained (keep {self.keep})")
        if self.num_mapped != int(self.mapped.sum()) or self.num_live != int((self.refs > 0).sum()):
            out.append(f"vmm: counters mapped {self.num_mapped} live {self.num_live} disagree with the arrays")
        per_buffer = np.bincount(self.layout.buffer_of_chunk[self.mapped], minlength=len(self.mapped_per_buffer))
        if not np.array_equal(per_buffer, self.mapped_per_buffer):
            out.append("vmm: per-buffer mapped counts disagree with the mapped set")
        if self.driver.mapped_offsets() != {c << self.shift for c in np.flatnonzero(self.mapped).tolist()}:
            out.append("vmm: the driver's mapped set differs from the bookkeeping")
        if self.max_chunks is not None and self.num_mapped > self.max_chunks:
            out.append(f"vmm: {self.num_mapped} chunks mapped, cap {self.max_chunks}")
        return out
