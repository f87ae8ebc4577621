"""Chunk bookkeeping: which chunks are mapped, how many live units each holds, when to unmap.

Independent of CUDA: it drives any kvatlas.vmm.driver.Driver. The allocator tells it which unit
ids of which index space go live (acquire) and die (release); it keeps, per chunk, the count of
live units touching it (`refs`). Invariants (checked by `problems()`):
  - a chunk with refs > 0 is mapped (a live page is always backed);
  - a chunk is unmapped only when refs == 0;
  - physical bytes == mapped chunks × chunk bytes, and ≤ max_physical_bytes when set.

Hysteresis: a chunk whose last live unit goes is not unmapped at once but kept ("retained") in
a FIFO of up to `keep_empty_chunks`; the oldest goes first. A decode batch whose pages cross a
chunk boundary back and forth would otherwise map and unmap the same chunk every few steps.
`trim()` unmaps every retained chunk now. Retained chunks count as physical (they are), and are
given up first when the physical cap or the device needs room.

acquire() is all-or-nothing: the cap is checked before anything changes, and if the device runs
out of memory midway, the chunks this call mapped are unmapped again and the call raises
PoolExhaustedError("physical"); refs, the live set and the caller's state stay as they were
(only empty chunks may have been given back to make room).

The decode path is kept cheap (a decode step hands out and retires a few units per index space):
  - per index space, a count per unit of the chunks it touches that are unmapped. acquire() of
    units whose counts are all 0 needs no chunk work: one gather. A map or an unmap moves the
    counts of the units lying in that chunk (one id range per chunk);
  - the reference counts are brought up to date lazily, in one vectorised pass ("settle") over
    the units acquired and released since the last one. Until then a retained chunk that
    received units stays in the FIFO (it is mapped; settle takes it back out before anything
    is unmapped), and a chunk emptied by releases of window-retired pages (release(...,
    defer=True), the allocator's decode path) stays live and mapped: an unsettled empty chunk,
    backing nothing, never unmapped under a live unit. Every other release settles at once, as
    do problems(), trim(), every unmap, any decision under the physical cap, a device out of
    memory, 512 pending units, and reading `refs`, `num_live` or `retained`: what those show
    is what eager counting would show. `mapped`, `num_mapped` and physical_bytes report the
    mapping as it is, with no side effects (a metrics scrape from another thread changes nothing).
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import PoolExhaustedError
from ..units import fmt_bytes
from .driver import DeviceOutOfMemory
from .layout import ChunkLayout

_nonzero = np.count_nonzero   # on a few elements several times faster than ndarray.any()
SETTLE_UNITS = 512   # deferred releases pending before a settle: bounds the unsettled empty chunks


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
        self._live = np.zeros(n + 1, bool)    # mapped and counted live (refs > 0 once settled)
        self._live[n] = True
        self._retained: dict[int, None] = {}   # mapped, refs == 0, oldest first
        self.num_mapped = self._num_live = 0
        self.mapped_per_buffer = np.zeros(len(layout.placed), np.int64)
        self.pinned = np.zeros(0, np.int64)
        self.map_calls = self.unmap_calls = 0
        self.map_seconds = 0.0
        # per index space: unit id → how many of the chunks it touches are unmapped
        self._missing = {g: (t != layout.sentinel).sum(axis=1).astype(np.int32) for g, t in layout.tables.items()}
        self._missing_by_index = [self._missing[g] for g in layout.group_names]
        self._chunk_group = layout.chunk_group.tolist()       # Python lists: read a few at a time
        self._chunk_lo = layout.chunk_unit_lo.tolist()
        self._chunk_hi = layout.chunk_unit_hi.tolist()
        self._buffer_of_chunk = layout.buffer_of_chunk.tolist()
        self._adds: list = []    # (group, ids) acquired since the last settle: not yet in refs
        self._subs: list = []    # (group, ids) released since the last settle: not yet in refs
        self._pending = 0        # units in _adds and _subs
        self.refused = None      # (group, ids) of the last units refused for the cap (fits_after)

    # ---------------------------------------------------------------- exact views
    @property
    def refs(self) -> np.ndarray:
        self.settle()
        return self._refs[:-1]

    @property
    def mapped(self) -> np.ndarray:
        return self._mapped[:-1]

    @property
    def num_live(self) -> int:
        self.settle()
        return self._num_live

    @property
    def retained(self) -> dict[int, None]:
        self.settle()
        return self._retained

    @property
    def physical_bytes(self) -> int:
        return self.num_mapped << self.shift

    # ---------------------------------------------------------------- start
    def pin(self, chunks: np.ndarray) -> None:
        """Map chunks for the arena's whole life (null units, tables, workspace)."""
        self._map(chunks)
        self._refs[chunks] += 1
        self._live[chunks] = True
        self._num_live += len(chunks)
        self.pinned = chunks

    # ---------------------------------------------------------------- units go live
    def _chunks(self, requests) -> np.ndarray:
        parts = [self.layout.chunks_of(group, ids) for group, ids in requests if len(ids)]
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def shortfall(self, requests):
        """PoolExhaustedError if giving these units backing would pass max_physical_bytes, else None.
        requests: (group, unit ids) pairs. Changes nothing (a settle may run: no one can tell)."""
        if self.max_chunks is None:
            return None
        self.settle()   # the cap counts live chunks exactly
        short = self._cap_shortfall(self._chunks(requests))
        if short is not None:
            self.refused = list(requests)
        return short

    def fits_after(self, requests, freed, lowest) -> bool:
        """Whether units `requests` ((group, ids) pairs: the last refused, `refused`) would fit
        under max_physical_bytes once every unit of `freed` (pairs, each id once) were let go:
        the chunks those leave with nothing live are given up, and a group whose ids go out
        lowest-first (`lowest(group, n)`: its n lowest free ids now) hands out the lowest of its
        free and freed ids instead, which may lie in chunks mapped now. What eviction could
        mend, asked before anything is evicted (the prefix cache under the cap). Changes
        nothing (a settle may run: no one can tell)."""
        if self.max_chunks is None:
            return True
        self.settle()
        refs, n = self._refs, len(self._refs)
        gone = np.zeros(n, bool)
        lost = 0
        freed_by = {}
        for group, ids in freed:
            if len(ids):
                freed_by.setdefault(group, []).append(np.asarray(ids, np.int64))
        chunks = self._chunks([(g, np.concatenate(f)) for g, f in freed_by.items()])
        if len(chunks):
            gone = (np.bincount(chunks, minlength=n) == refs) & (refs > 0)
            gone[-1] = False   # (the sentinel)
            lost = int(np.count_nonzero(gone))
        parts = []
        for group, ids in requests:
            f = freed_by.get(group)
            if f is not None and len(ids):
                ids = np.sort(np.concatenate([lowest(group, len(ids))] + f))[:len(ids)]
            parts.append((group, ids))
        want = self._chunks(parts)
        need = len(_distinct(want[~self._live[want] | gone[want]])) if len(want) else 0
        return self._num_live - lost + need <= self.max_chunks

    def _revive(self, chunks: np.ndarray) -> list:
        """The chunks among these that are not live now (retained or unmapped), once each, ascending."""
        return _distinct(chunks[~self._live[chunks]])

    def _cap_shortfall(self, chunks: np.ndarray):
        if self.max_chunks is None or len(chunks) == 0:
            return None
        revive = self._revive(chunks)
        if self._num_live + len(revive) <= self.max_chunks:
            return None
        free = max(self.max_chunks - self._num_live, 0) << self.shift
        return PoolExhaustedError("physical", len(revive) << self.shift, free, "bytes",
                                  f"max_physical_bytes={self.max_chunks << self.shift} "
                                  f"({fmt_bytes(self.max_chunks << self.shift)}) would be exceeded")

    def acquire(self, requests) -> None:
        """Back every chunk the units touch and count them live; all or nothing."""
        new = None
        count = 0
        for group, ids in requests:
            count += len(ids)
            missing = self._missing.get(group)
            if missing is not None and len(ids):
                m = missing[ids]
                if _nonzero(m):   # some unit lies in an unmapped chunk: which chunks are those
                    mapped = self._mapped
                    rows = self.layout.tables[group][ids[m > 0]].tolist()
                    new = (new or set()) | {c for row in rows for c in row if not mapped[c]}
        if new is not None:   # (otherwise: the decode step's way, nothing to do but count)
            if self.max_chunks is not None:
                self._acquire_exact(requests)
            else:
                new = sorted(new)
                try:
                    self._map(new)
                except DeviceOutOfMemory:
                    self._acquire_exact(requests)   # settles, gives back retained chunks, or refuses
                else:
                    live = self._live
                    for c in new:
                        live[c] = True
                    self._num_live += len(new)
        self._adds.extend(requests)
        self._pending += count
        if self._pending >= SETTLE_UNITS:
            self.settle()

    def _acquire_exact(self, requests) -> None:
        """The eager way, on settled counts: cap check, give back retained chunks for room, map,
        count live. Changes nothing but retained chunks given back if it refuses."""
        self.settle()
        chunks = self._chunks(requests)
        short = self._cap_shortfall(chunks)
        if short is not None:
            self.refused = list(requests)
            raise short
        revive = self._revive(chunks)
        mapped = self._mapped
        new = [c for c in revive if not mapped[c]]
        if new:
            self._make_room(len(new), protect=revive)
            self._map_or_refuse(new, protect=revive)
        if revive:
            if self._retained:
                for c in revive:
                    self._retained.pop(c, None)
            self._live[revive] = True
            self._num_live += len(revive)

    def _count_units(self, chunks: list, delta: int) -> None:
        """Chunks were mapped (delta -1) or unmapped (+1): move the counts of the units in them."""
        groups, lo, hi, missing = self._chunk_group, self._chunk_lo, self._chunk_hi, self._missing_by_index
        for c in chunks:
            g = groups[c]
            if g >= 0:
                m, a, z = missing[g], lo[c], hi[c] + 1
                if z - a > 4:
                    m[a:z] += delta
                else:              # a few units: scalar updates beat one slice op
                    for u in range(a, z):
                        m[u] += delta

    def _make_room(self, num_new: int, protect: list) -> None:
        """Give back retained chunks so that mapping num_new more stays within the cap."""
        if self.max_chunks is None:
            return
        excess = self.num_mapped + num_new - self.max_chunks
        if excess > 0:
            self._evict(excess, protect)

    def _map_or_refuse(self, new: list, protect: list) -> None:
        try:
            self._map(new)
        except DeviceOutOfMemory as first:
            if not self._retained:
                raise self._oom(new, first) from None
            self._evict(len(self._retained), protect)   # the device needs memory: give back the cache
            try:
                self._map(new)
            except DeviceOutOfMemory as second:
                raise self._oom(new, second) from None

    def _oom(self, new: list, err) -> PoolExhaustedError:
        self.refused = None   # (the device's memory, not the cap: what eviction frees is not known here)
        return PoolExhaustedError("physical", len(new) << self.shift, 0, "bytes",
                                  f"the device is out of memory ({err}); nothing was mapped")

    def _map(self, chunks) -> None:
        """Map each chunk (a list or an array); if one fails, unmap those this call mapped and re-raise."""
        chunks = chunks.tolist() if isinstance(chunks, np.ndarray) else chunks
        done = []
        t0 = time.perf_counter()
        try:
            for c in chunks:
                self.driver.map(c << self.shift, self.G)
                done.append(c)
        except BaseException:
            for c in done:
                self.driver.unmap(c << self.shift, self.G)
            raise
        finally:
            self.map_seconds += time.perf_counter() - t0
        self.map_calls += len(done)
        if len(chunks) > 8:
            self._mapped[chunks] = True
        else:
            for c in chunks:
                self._mapped[c] = True
        self.num_mapped += len(chunks)
        self._per_buffer(chunks, 1)
        self._count_units(chunks, -1)

    def _per_buffer(self, chunks: list, delta: int) -> None:
        if len(chunks) > 16:
            np.add.at(self.mapped_per_buffer, self.layout.buffer_of_chunk[chunks], delta)
            return
        buffers, counts = self._buffer_of_chunk, self.mapped_per_buffer
        for c in chunks:
            counts[buffers[c]] += delta

    # ---------------------------------------------------------------- units die
    def release(self, group: str, ids: np.ndarray, defer: bool = False) -> None:
        """Units died. defer=True (window-retired pages of a decode step): their chunks may stay
        live until the next settle; otherwise settle now."""
        if len(ids) == 0:
            return
        self._subs.append((group, ids))
        self._pending += len(ids)
        if not defer or self._pending >= SETTLE_UNITS:
            self.settle()

    def settle(self) -> None:
        """Bring the reference counts up to date: retained chunks that received units are live
        again; chunks left with nothing live become retained (the oldest beyond
        keep_empty_chunks are unmapped)."""
        if not self._pending:
            return
        self._pending = 0
        refs = self._refs
        if self._adds:
            np.add.at(refs, self._chunks(self._adds), 1)
            self._adds.clear()
        subs = None
        if self._subs:
            subs = self._chunks(self._subs)
            self._subs.clear()
            np.subtract.at(refs, subs, 1)
        if self._retained:
            back = [c for c in self._retained if refs[c] > 0]
            for c in back:
                del self._retained[c]
            self._live[back] = True
            self._num_live += len(back)
        if subs is None:
            return
        zero = (refs[subs] == 0) & self._live[subs]
        if not _nonzero(zero):
            return
        dead = _distinct(subs[zero])
        self._live[dead] = False
        self._num_live -= len(dead)
        for c in dead:
            self._retained[c] = None
        if len(self._retained) > self.keep:
            self._evict(len(self._retained) - self.keep)

    def trim(self) -> int:
        """Unmap every chunk that holds nothing live; returns the bytes given back."""
        self.settle()
        n = len(self._retained)
        self._evict(n)
        return n << self.shift

    def _evict(self, count: int, protect: list | None = None) -> None:
        """Unmap up to count retained chunks, oldest first (callers have settled: every retained
        chunk holds nothing live)."""
        keep = set() if protect is None else set(protect)
        victims = [c for c in self._retained if c not in keep][:count]
        if not victims:
            return
        self.driver.quiesce()   # queued kernels may still read these chunks
        for c in victims:
            self.driver.unmap(c << self.shift, self.G)
            del self._retained[c]
        self._mapped[victims] = False
        self.num_mapped -= len(victims)
        self.unmap_calls += len(victims)
        self._per_buffer(victims, -1)
        self._count_units(victims, 1)

    # ---------------------------------------------------------------- checks
    def problems(self, live_units: dict) -> list[str]:
        """Recount refs from the live unit ids of every group and compare with every counter."""
        self.settle()
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
        if not np.array_equal(self._live[:-1], self.refs > 0):
            out.append(f"vmm: live flags disagree with refs at {np.flatnonzero(self._live[:-1] != (self.refs > 0))[:8]}")
        for g, t in self.layout.tables.items():
            if not np.array_equal(self._missing[g], (~self._mapped[t]).sum(axis=1)):
                out.append(f"vmm: {g}: per-unit counts of unmapped chunks disagree with the mapping")
        empty = set(np.flatnonzero(self.mapped & (self.refs == 0)).tolist())
        if empty != set(self._retained) or len(self._retained) > self.keep:
            out.append(f"vmm: {len(empty)} empty mapped chunks, {len(self._retained)} retained (keep {self.keep})")
        if self.num_mapped != int(self.mapped.sum()) or self._num_live != int((self.refs > 0).sum()):
            out.append(f"vmm: counters mapped {self.num_mapped} live {self._num_live} disagree with the arrays")
        per_buffer = np.bincount(self.layout.buffer_of_chunk[self.mapped], minlength=len(self.mapped_per_buffer))
        if not np.array_equal(per_buffer, self.mapped_per_buffer):
            out.append("vmm: per-buffer mapped counts disagree with the mapped set")
        if self.driver.mapped_offsets() != {c << self.shift for c in np.flatnonzero(self.mapped).tolist()}:
            out.append("vmm: the driver's mapped set differs from the bookkeeping")
        if self.max_chunks is not None and self.num_mapped > self.max_chunks:
            out.append(f"vmm: {self.num_mapped} chunks mapped, cap {self.max_chunks}")
        return out


def _distinct(chunks: np.ndarray) -> list:
    """Distinct values, ascending, as a list (a set for the few of a decode step, numpy beyond)."""
    if len(chunks) > 64:
        return np.unique(chunks).tolist()
    return sorted(set(chunks.tolist()))
