"""The host tier: cached pages and checkpoints evicted from the device wait in pinned host
memory and come back byte for byte.

    tier = HostTier(cache, "128GiB")
    moved = tier.offload_pages(keys, device_pages)       # before the device pages are freed
    moved.evicted                                        # host LRU entries dropped to make room
    t = tier.restore_pages(keys, new_device_pages)       # on the copy stream; returns at once
    t.done() / t.wait()                                  # ready / compute stream waits for it

The tier owns: its host buffer map (`planning.hostplan`), the pinned slab (`memory`), one
index space per kind with its own LRU (`slots`), the copy engine (`copies`) and its ledger
section (`ledger`). It never frees or allocates device units: the caller (the prefix cache)
decides which units to move and hands units back to the allocator itself; a move to host
fences the compute stream, so handing the units back right after is safe.

Moves are exclusive: a restored entry leaves host memory (its slot is free again; the copy
stream's order keeps it from being overwritten before the restore has read it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..planning.buffers import SWA_PAGES
from ..planning.hostplan import DEFAULT_CHECKPOINT_SHARE, HOST_CHECKPOINTS, HOST_PAGES, plan_host
from ..units import MIB, parse_bytes
from .copies import CopyEngine, RowMove, Transfer, UnitMove
from .ledger import GROUP_LABEL, HOST_LEDGER_SCHEMA_VERSION, HostGroupUsage, HostSnapshot, MoveCounters, group_measures
from .memory import HostMemory
from .slots import HostSlots

DEFAULT_STAGING_BYTES = 64 * MIB   # a 64-MiB copy reaches the pinned H2D plateau (SPEC §7)
KINDS = {"page": HOST_PAGES, "checkpoint": HOST_CHECKPOINTS}


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointAt:
    """Where one checkpoint lives on the device: the SWA pages under the window − 1 tokens before
    the boundary (oldest first; paged layouts), and `unit`: with the prefix cache, its checkpoint
    unit (the CHECKPOINTS buffers); without, the request slot whose rings hold the rows, with
    `first_row` the ring row of the first resume row ((boundary − rows) modulo the ring)."""

    swa_pages: tuple = ()
    unit: int = 0
    first_row: int = 0


@dataclass(frozen=True, slots=True)
class Offload:
    transfer: Transfer
    evicted: tuple      # keys the host LRU dropped to make room: forget them


def _raw(t, dims: int):
    import torch
    return t.view(torch.uint8).reshape(*t.shape[:dims], -1)


class HostTier:
    def __init__(self, cache, host_memory_bytes, *, checkpoint_share: float = DEFAULT_CHECKPOINT_SHARE,
                 pin: bool | None = None, staging_bytes: int | str = DEFAULT_STAGING_BYTES) -> None:
        self.cache = cache
        self.plan = plan_host(cache.plan, host_memory_bytes, checkpoint_share)
        largest = max(b.unit_bytes // self.plan.sources[b.name].device_units for b in self.plan.buffers)
        self.memory = HostMemory(self.plan, pin)
        try:
            self.engine = CopyEngine(cache.device, parse_bytes(staging_bytes, "staging_bytes"), largest)
        except BaseException:
            self.memory.release()
            raise
        self.slots = {g: HostSlots(f"host {GROUP_LABEL[g]}", n) for g, n in self.plan.units.items()}
        self.moves = MoveCounters()
        self._in_flight: list[Transfer] = []
        regions = cache.arena.regions
        self._device = {b.name: regions[s.buffer].tensor for b in self.plan.buffers
                        for s in (self.plan.sources[b.name],)}
        self._source_group = {b.name: regions[self.plan.sources[b.name].buffer].spec.group for b in self.plan.buffers}
        self._ring_rows = {s.buffer: regions[s.buffer].spec.entries_per_unit for s in self.plan.sources.values()}

    # ------------------------------------------------------------------ queries
    def contains(self, kind: str, key) -> bool:
        return key in self.slots[_group(kind)]

    def resident(self, kind: str) -> list:
        """Resident keys of one kind, least recently used first."""
        return self.slots[_group(kind)].keys()

    def touch(self, kind: str, keys) -> None:
        s = self.slots[_group(kind)]
        s.check_resident(list(keys))
        s.touch(keys)

    def drop(self, kind: str, keys) -> None:
        """Forget resident entries without copying them back (their prefix is gone)."""
        g = _group(kind)
        keys = list(keys)
        self.slots[g].check_resident(keys)
        self.slots[g].take(keys)
        self.moves.dropped[g] += len(keys)

    # ------------------------------------------------------------------ moves
    def offload_pages(self, keys, device_pages) -> Offload:
        keys, pages = list(keys), self._units(device_pages, len(keys), "device_pages")
        return self._offload(HOST_PAGES, keys, lambda slots: self._page_moves(slots, pages))

    def restore_pages(self, keys, device_pages) -> Transfer:
        keys, pages = list(keys), self._units(device_pages, len(keys), "device_pages")
        return self._restore(HOST_PAGES, keys, lambda slots: self._page_moves(slots, pages))

    def offload_checkpoints(self, keys, at) -> Offload:
        keys, at = list(keys), self._checkpoints(at, len(keys))
        return self._offload(HOST_CHECKPOINTS, keys, lambda slots: self._checkpoint_moves(slots, at))

    def restore_checkpoints(self, keys, at) -> Transfer:
        keys, at = list(keys), self._checkpoints(at, len(keys))
        return self._restore(HOST_CHECKPOINTS, keys, lambda slots: self._checkpoint_moves(slots, at))

    def _offload(self, group: str, keys: list, moves_for) -> Offload:
        self.slots[group].check_new(keys)
        slots, evicted = self.slots[group].put(keys)
        t = self.engine.run("host", moves_for(slots))
        m = self.moves
        m.bytes_to_host += t.nbytes
        m.moved_to_host[group] += len(keys)
        m.evicted[group] += len(evicted)
        self._track(t)
        return Offload(transfer=t, evicted=tuple(evicted))

    def _restore(self, group: str, keys: list, moves_for) -> Transfer:
        s = self.slots[group]
        s.check_resident(keys)
        slots = np.fromiter((s.slot(k) for k in keys), dtype=np.int64, count=len(keys))
        t = self.engine.run("device", moves_for(slots))
        s.take(keys)
        self.moves.bytes_to_device += t.nbytes
        self.moves.moved_to_device[group] += len(keys)
        self._track(t)
        return t

    def _page_moves(self, slots: np.ndarray, pages: np.ndarray) -> list:
        return [UnitMove(self.memory.raw[b.name], _raw(self._device[b.name], 1), slots, pages)
                for b in self.plan.group_buffers(HOST_PAGES)]

    def _checkpoint_moves(self, slots: np.ndarray, at: list[CheckpointAt]) -> list:
        out = []
        units = np.array([a.unit for a in at], dtype=np.int64)
        for b in self.plan.group_buffers(HOST_CHECKPOINTS):
            src, dev, host = self.plan.sources[b.name], self._device[b.name], self.memory.raw[b.name]
            if src.rows:
                row_bytes = b.entry_bytes
                firsts = np.array([a.first_row for a in at], dtype=np.int64) * row_bytes
                out.append(RowMove(host.view(b.units, len(b.layers), src.rows * row_bytes), _raw(dev, 2),
                                   slots, units, firsts))
            elif self._source_group[b.name] == SWA_PAGES:
                m = src.device_units
                rows = (slots[:, None] * m + np.arange(m)).reshape(-1)
                pages = np.array([p for a in at for p in a.swa_pages], dtype=np.int64)
                out.append(UnitMove(host.view(b.units * m, -1), _raw(dev, 1), rows, pages))
            else:   # a V4.1 request window: one whole unit of the request slot
                out.append(UnitMove(host, _raw(dev, 1), slots, units))
        return out

    # ------------------------------------------------------------------ checks of input
    def _units(self, units, n: int, field: str) -> np.ndarray:
        arr = np.asarray(units, dtype=np.int64).reshape(-1) if len(units) else np.zeros(0, np.int64)
        if len(arr) != n:
            raise ConfigError(field, f"{len(arr)} units for {n} keys", "give one device unit per key")
        top = self.cache.plan.num_full_pages
        if len(arr) and (arr.min() < 1 or arr.max() >= top):
            raise ConfigError(field, f"a page id lies outside 1..{top - 1}", "give full-page ids the allocator handed out")
        if len(np.unique(arr)) != len(arr):
            raise ConfigError(field, "a device page is given twice", "give each page once")
        return arr

    def _checkpoints(self, at, n: int) -> list[CheckpointAt]:
        at = list(at)
        if len(at) != n:
            raise ConfigError("at", f"{len(at)} checkpoint places for {n} keys", "give one CheckpointAt per key")
        plan = self.cache.plan
        units = min((self.cache.arena.regions[s.buffer].spec.units for b, s in self.plan.sources.items()
                     if b.startswith("checkpoint.") and self._source_group[b] != SWA_PAGES), default=0)
        tail = max((s.device_units for b, s in self.plan.sources.items() if self._source_group[b] == SWA_PAGES),
                   default=0)
        for a in at:
            if not isinstance(a, CheckpointAt):
                raise ConfigError("at", f"{a!r} is not a CheckpointAt", "describe each checkpoint with CheckpointAt")
            if tail and (len(a.swa_pages) != tail or min(a.swa_pages) < 1 or max(a.swa_pages) >= plan.num_swa_pages):
                raise ConfigError("at.swa_pages", f"{a.swa_pages!r} is not {tail} SWA page ids in 1..{plan.num_swa_pages - 1}",
                                  "give the SWA pages under the window before the boundary, oldest first")
            if units and not 1 <= a.unit < units:
                raise ConfigError("at.unit", f"{a.unit} is not a unit in 1..{units - 1}",
                                  "give the request slot (or prefix-cache checkpoint unit) holding the rows")
            rings = [self._ring_rows[s.buffer] - s.rows for s in self.plan.sources.values() if s.rows]
            if rings and not 0 <= a.first_row <= min(rings):
                raise ConfigError("at.first_row", f"{a.first_row} leaves the resume rows outside the ring",
                                  f"give (boundary - resume rows) % ring, at most {min(rings)}")
        return at

    # ------------------------------------------------------------------ accounting
    def _track(self, t: Transfer) -> None:
        self._in_flight.append(t)
        self.poll()

    def poll(self) -> int:
        """Retire transfers that have landed (restore latencies into the counters); in flight left."""
        left = []
        for t in self._in_flight:
            if not t.done():
                left.append(t)
            elif t.direction == "device":
                lat = t.latency_s
                self.moves.restores += 1
                self.moves.restore_latency_sum_s += lat
                self.moves.restore_latency_max_s = max(self.moves.restore_latency_max_s, lat)
        self._in_flight = left
        return len(left)

    def synchronize(self) -> None:
        for t in self._in_flight:
            t.synchronize()
        self.poll()

    def snapshot(self, hits: dict | None = None) -> HostSnapshot:
        in_flight = self.poll()
        groups, total = {}, None
        for g, s in self.slots.items():
            m = group_measures(self.plan, g, s.used, self.memory.span_bytes)
            groups[GROUP_LABEL[g]] = HostGroupUsage(measures=m, units_total=s.units, units_used=s.used,
                                                    unit_bytes=self.plan.unit_bytes(g))
            total = m if total is None else total + m
        mv = self.moves
        return HostSnapshot(
            schema_version=HOST_LEDGER_SCHEMA_VERSION, pinned=self.memory.pinned, copy_device=str(self.engine.device),
            totals=total, groups=groups, staging_device_bytes=self.engine.staging_bytes,
            bytes_to_host=mv.bytes_to_host, bytes_to_device=mv.bytes_to_device,
            moved_to_host={GROUP_LABEL[g]: v for g, v in mv.moved_to_host.items()},
            moved_to_device={GROUP_LABEL[g]: v for g, v in mv.moved_to_device.items()},
            evicted={GROUP_LABEL[g]: v for g, v in mv.evicted.items()},
            dropped={GROUP_LABEL[g]: v for g, v in mv.dropped.items()},
            restores_completed=mv.restores, restore_latency_sum_s=mv.restore_latency_sum_s,
            restore_latency_max_s=mv.restore_latency_max_s, transfers_in_flight=in_flight, hits=hits or {})

    def check_integrity(self) -> HostSnapshot:
        from ..errors import IntegrityError
        for s in self.slots.values():
            s.check_integrity()
        snap = self.snapshot()
        problems = snap.totals.violations("host total")
        if self.memory.tensor_bytes != self.plan.total_bytes:
            problems.append(f"host: planned {self.plan.total_bytes} != tensor {self.memory.tensor_bytes}")
        if problems:
            raise IntegrityError("host ledger invariants broken: " + "; ".join(problems))
        return snap

    def close(self) -> None:
        self.synchronize()
        self.memory.release()


def _group(kind: str) -> str:
    if kind not in KINDS:
        raise ConfigError("kind", f"{kind!r} is not a host entry kind", "use 'page' or 'checkpoint'")
    return KINDS[kind]
