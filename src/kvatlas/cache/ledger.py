"""The ledger: every measure of every buffer, pool, layer kind and the whole cache, kept live.

Measures (DESIGN §3), with occupied ≤ addressable ≤ tensor ≤ reserved and physical ≤ reserved:
planned (the plan), tensor (storages allocated), reserved (address space or allocator segments),
physical (memory backing them), addressable (what the allocator can hand out), occupied (live
request data), evictable (the part of occupied the prefix cache holds and no running request
reads: free for a new request is addressable - occupied + evictable). Occupied is kept as counters the allocator moves by deltas, so a snapshot reads
a dozen counters whatever the number of requests or pages: O(1).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..planning.buffers import CHECKPOINTS, FULL_PAGES, REQUEST_SLOTS, SWA_PAGES, WORKSPACE, BufferSpec
from ..errors import IntegrityError, KvatlasError

LEDGER_SCHEMA_VERSION = 1
MEASURES = ("planned", "tensor", "reserved", "physical", "addressable", "occupied", "evictable")


@dataclass(frozen=True, slots=True, kw_only=True)
class Measures:
    planned_bytes: int
    tensor_bytes: int
    reserved_bytes: int
    physical_bytes: int
    addressable_bytes: int
    occupied_bytes: int
    evictable_bytes: int = 0

    def __add__(self, other: "Measures") -> "Measures":
        return Measures(**{f"{m}_bytes": getattr(self, f"{m}_bytes") + getattr(other, f"{m}_bytes") for m in MEASURES})

    def as_dict(self) -> dict:
        return {m: getattr(self, f"{m}_bytes") for m in MEASURES}

    def violations(self, where: str, backed: bool = True) -> list[str]:
        """Broken invariants. backed=False (bookkeeping backend, nothing allocated): the chain ends
        at planned, and tensor, reserved and physical must all be 0."""
        m = self
        chain = [("occupied", m.occupied_bytes), ("addressable", m.addressable_bytes),
                 ("tensor", m.tensor_bytes), ("reserved", m.reserved_bytes)]
        chain = [("evictable", m.evictable_bytes)] + chain
        if not backed:   # by name, so a measure added to the chain's head keeps its place
            chain = [c for c in chain if c[0] not in ("tensor", "reserved")] + [("planned", m.planned_bytes)]
            if m.tensor_bytes or m.reserved_bytes or m.physical_bytes:
                return [f"{where}: nothing is allocated, yet tensor/reserved/physical = {m.tensor_bytes}/"
                        f"{m.reserved_bytes}/{m.physical_bytes}"]
        out = [f"{where}: {a} {x} > {b} {y}" for (a, x), (b, y) in zip(chain, chain[1:]) if x > y]
        if m.physical_bytes > m.reserved_bytes:
            out.append(f"{where}: physical {m.physical_bytes} > reserved {m.reserved_bytes}")
        if min(m.as_dict().values()) < 0:
            out.append(f"{where}: a negative measure {m.as_dict()}")
        return out


ZERO = Measures(planned_bytes=0, tensor_bytes=0, reserved_bytes=0, physical_bytes=0, addressable_bytes=0,
                occupied_bytes=0, evictable_bytes=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolUsage:
    name: str
    role: str
    group: str
    layer_kind: str
    measures: Measures
    units_total: int        # addressable units: pages or request slots (null excluded)
    units_used: int
    entries_total: int      # addressable entries per layer (rows, tokens)
    entries_used: int


@dataclass(frozen=True, slots=True, kw_only=True)
class LedgerSnapshot:
    schema_version: int
    device: str
    backend: str
    planned_bytes: int
    tensor_bytes: int
    reserved_bytes: int
    physical_bytes: int
    addressable_bytes: int
    occupied_bytes: int
    evictable_bytes: int
    pools: dict
    layer_kinds: dict
    running_requests: int
    admission_refusals: int

    @property
    def totals(self) -> Measures:
        return Measures(**{f"{m}_bytes": getattr(self, f"{m}_bytes") for m in MEASURES})

    @property
    def mem_usage_gib(self) -> float:
        return self.tensor_bytes / 2**30

    def to_dict(self) -> dict:
        return {
            "schema": "kvatlas.ledger", "schema_version": self.schema_version, "device": self.device,
            "backend": self.backend, "totals": self.totals.as_dict(), "mem_usage_gib": self.mem_usage_gib,
            "running_requests": self.running_requests, "admission_refusals": self.admission_refusals,
            "pools": {name: {"role": p.role, "group": p.group, "layer_kind": p.layer_kind,
                             "units_total": p.units_total, "units_used": p.units_used,
                             "entries_total": p.entries_total, "entries_used": p.entries_used,
                             **p.measures.as_dict()} for name, p in self.pools.items()},
            "layer_kinds": {k: m.as_dict() for k, m in self.layer_kinds.items()},
        }


def entry_key(spec: BufferSpec) -> str:
    """Which live-entry counter a buffer's occupancy follows: paged pools count entries of their
    layer kind; per-slot buffers count slots in use."""
    if spec.group in (SWA_PAGES, FULL_PAGES):
        return spec.layer_kind
    return spec.group


class Ledger:
    """Counters moved by the allocator; measures read from the plan and the arena's backend."""

    def __init__(self, plan, arena) -> None:
        self.plan = plan
        self.arena = arena
        self.entries_used: dict[str, int] = {}   # per entry key: live entries per layer, or slots
        self.units_used = {SWA_PAGES: 0, FULL_PAGES: 0, REQUEST_SLOTS: 0, WORKSPACE: 0, CHECKPOINTS: 0}
        # units the prefix cache holds that no running request reads (pages, checkpoint units)
        self.units_evictable = {SWA_PAGES: 0, FULL_PAGES: 0, CHECKPOINTS: 0}
        self.running_requests = 0
        self.admission_refusals = 0
        self.checkpoints_skipped = 0   # resume points not saved: no checkpoint unit free or evictable
        self._pools: dict[str, list[BufferSpec]] = plan.pools()

    # --- moved by the allocator (O(1) per call) ---
    def add_units(self, group: str, delta: int) -> None:
        self.units_used[group] += delta

    def add_evictable(self, group: str, delta: int) -> None:
        self.units_evictable[group] += delta

    def add_entries(self, key: str, delta: int) -> None:
        self.entries_used[key] = self.entries_used.get(key, 0) + delta

    # --- read ---
    def buffer_measures(self, spec: BufferSpec) -> Measures:
        region = self.arena.regions[spec.name]
        reserved, physical = self.arena.backend.buffer_backing(spec.name, region.tensor_bytes)
        return Measures(planned_bytes=spec.bytes, tensor_bytes=region.tensor_bytes, reserved_bytes=reserved,
                        physical_bytes=physical, addressable_bytes=spec.addressable_bytes,
                        occupied_bytes=self._occupied(spec), evictable_bytes=self._evictable(spec))

    def _occupied(self, spec: BufferSpec) -> int:
        key = entry_key(spec)
        if spec.group in (SWA_PAGES, FULL_PAGES):
            return self.entries_used.get(key, 0) * spec.entry_bytes * len(spec.layers)
        if spec.group in (REQUEST_SLOTS, CHECKPOINTS):
            return self.units_used[spec.group] * spec.unit_payload_bytes
        return 0

    def _evictable(self, spec: BufferSpec) -> int:
        """Cached pages are complete (every entry live); a checkpoint unit is whole."""
        return self.units_evictable.get(spec.group, 0) * spec.unit_payload_bytes

    def occupied_bytes(self) -> int:
        """The total occupied bytes alone: a few counters, for a caller that needs it every pass
        and the full snapshot (which builds every pool's measures) only now and then."""
        return sum(self._occupied(s) for specs in self._pools.values() for s in specs)

    def snapshot(self) -> LedgerSnapshot:
        pools, kinds = {}, {}
        for name, specs in self._pools.items():
            m = ZERO
            for s in specs:
                m = m + self.buffer_measures(s)
            s0 = specs[0]
            units_total = s0.addressable_units
            per_unit = s0.entries_per_unit
            used_units = self.units_used[s0.group]
            used_entries = (self.entries_used.get(entry_key(s0), 0) if s0.group in (SWA_PAGES, FULL_PAGES)
                            else used_units * per_unit)
            pools[name] = PoolUsage(name=name, role=s0.role, group=s0.group, layer_kind=s0.layer_kind,
                                    measures=m, units_total=units_total, units_used=used_units,
                                    entries_total=units_total * per_unit, entries_used=used_entries)
            kinds[s0.layer_kind] = kinds.get(s0.layer_kind, ZERO) + m
        total = ZERO
        for p in pools.values():
            total = total + p.measures
        backend = self.arena.backend
        return LedgerSnapshot(
            schema_version=LEDGER_SCHEMA_VERSION, device=str(self.arena.device), backend=backend.name,
            planned_bytes=self.plan.total_bytes, tensor_bytes=backend.tensor_bytes,
            reserved_bytes=backend.reserved_bytes, physical_bytes=backend.physical_bytes,
            addressable_bytes=total.addressable_bytes, occupied_bytes=total.occupied_bytes,
            evictable_bytes=total.evictable_bytes, pools=pools, layer_kinds=kinds, running_requests=self.running_requests,
            admission_refusals=self.admission_refusals)

    @property
    def mem_usage_gib(self) -> float:
        return self.arena.backend.tensor_bytes / 2**30

    def check_integrity(self) -> LedgerSnapshot:
        snap = self.snapshot()
        backed = self.arena.backend.holds_memory
        problems = snap.totals.violations("total", backed)
        for name, p in snap.pools.items():
            problems += p.measures.violations(f"pool {name}", backed)
            if backed and p.measures.planned_bytes != p.measures.tensor_bytes:
                problems.append(f"pool {name}: planned {p.measures.planned_bytes} != tensor {p.measures.tensor_bytes}")
            if not 0 <= p.units_used <= p.units_total:
                problems.append(f"pool {name}: {p.units_used} units used of {p.units_total}")
        if backed and snap.planned_bytes != snap.tensor_bytes:
            problems.append(f"total: planned {snap.planned_bytes} != tensor {snap.tensor_bytes}")
        if problems:
            raise IntegrityError("ledger invariants broken: " + "; ".join(problems))
        return snap
