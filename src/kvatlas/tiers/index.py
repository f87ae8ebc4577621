"""The host tier's bookkeeping: which cached pages and checkpoints sit in host memory, in which
slot, in what LRU order, and every count its ledger section reports. Subclasses move the bytes:
`HostTier` (kvatlas.tiers.host) copies them through pinned memory; `ModeledHost`
(kvatlas.tiers.modeled) has no memory and charges each move the time the measured bandwidth
gives, for simulations of plans larger than the machine (DESIGN §6: the same hooks, another
backing).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, IntegrityError
from ..planning.buffers import SWA_PAGES
from ..planning.hostplan import DEFAULT_CHECKPOINT_SHARE, HOST_CHECKPOINTS, HOST_PAGES, plan_host
from .copies import Transfer
from .movetime import modeled_move_seconds
from .ledger import GROUP_LABEL, HOST_LEDGER_SCHEMA_VERSION, HostGroupUsage, HostSnapshot, MoveCounters, group_measures
from .slots import HostSlots

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
class Claim:
    """Host entries set aside for a restore: out of the host LRU, their slots still held."""

    kind: str
    keys: tuple
    slots: np.ndarray


@dataclass(frozen=True, slots=True)
class Offload:
    transfer: Transfer
    evicted: tuple      # keys the host LRU dropped to make room: forget them


class HostIndex:
    memory_backed = False
    pinned = False
    copy_device = "none"
    staging_bytes = 0

    def __init__(self, device_plan, host_memory_bytes, checkpoint_share: float = DEFAULT_CHECKPOINT_SHARE) -> None:
        self.device_plan = device_plan
        self.plan = plan_host(device_plan, host_memory_bytes, checkpoint_share)
        self.slots = {g: HostSlots(f"host {GROUP_LABEL[g]}", n) for g, n in self.plan.units.items()}
        self.moves = MoveCounters()
        self.modeled_seconds = {"host": 0.0, "device": 0.0}   # summed modeled move times, per direction
        self._in_flight: list[Transfer] = []
        spec = {s.buffer: device_plan.buffer(s.buffer) for s in self.plan.sources.values()}
        self._source_group = {b.name: spec[self.plan.sources[b.name].buffer].group for b in self.plan.buffers}
        self._ring_rows = {name: s.entries_per_unit for name, s in spec.items()}
        # a tier below (kvatlas.tiers.shared): told of the entries the host LRU is about to drop,
        # (group, keys, host slots), while their bytes are still in those slots
        self.on_victims = None

    @property
    def tensor_bytes(self) -> int:
        return 0

    @property
    def span_bytes(self) -> dict:
        return {b.name: 0 for b in self.plan.buffers}

    def _copy(self, direction: str, group: str, slots: np.ndarray, where) -> Transfer:
        """Move entries in host `slots` to or from `where` (device pages or CheckpointAt places)."""
        raise NotImplementedError

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

    def refuse_offload(self, kind: str) -> None:
        """Count an eviction the tier could not take (no host slot free of a claim)."""
        self.moves.refused[_group(kind)] += 1

    # ------------------------------------------------------------------ moves
    def offload_pages(self, keys, device_pages) -> Offload:
        keys, pages = list(keys), self._units(device_pages, len(keys), "device_pages")
        return self._offload(HOST_PAGES, keys, pages)

    def restore_pages(self, keys, device_pages) -> Transfer:
        keys = list(keys)
        pages = self._units(device_pages, len(keys), "device_pages")   # refused before the claim
        return self.restore(self.claim("page", keys), pages)

    def offload_checkpoints(self, keys, at) -> Offload:
        keys, at = list(keys), self._checkpoints(at, len(keys))
        return self._offload(HOST_CHECKPOINTS, keys, at)

    def restore_checkpoints(self, keys, at) -> Transfer:
        keys = list(keys)
        at = self._checkpoints(at, len(keys))
        return self.restore(self.claim("checkpoint", keys), at)

    def claim(self, kind: str, keys) -> Claim:
        """Set entries aside for a restore: no host eviction picks them until restore() copies
        them back (their slots then free) or unclaim() returns them to the LRU. Lets a caller
        make room on the device (evicting to host) before it knows where they go."""
        g, keys = _group(kind), list(keys)
        self.slots[g].check_resident(keys)
        return Claim(kind=kind, keys=tuple(keys), slots=self.slots[g].claim(keys))

    def unclaim(self, claim: Claim) -> None:
        self.slots[_group(claim.kind)].unclaim(claim.keys, claim.slots)

    def restore(self, claim: Claim, where) -> Transfer:
        """Copy claimed entries back: `where` is device page ids (pages) or CheckpointAt places.
        Bad `where` is refused with the claim returned to the LRU."""
        g = _group(claim.kind)
        try:
            if g == HOST_PAGES:
                where = self._units(where, len(claim.keys), "device_pages")
            else:
                where = self._checkpoints(where, len(claim.keys))
        except BaseException:
            self.unclaim(claim)
            raise
        t = self._modeled(self._copy("device", g, claim.slots, where), g, claim.slots)
        self.slots[g].free_claimed(claim.slots)
        self.moves.bytes_to_device += t.nbytes
        self.moves.moved_to_device[g] += len(claim.keys)
        self._track(t)
        return t

    def _make_room(self, group: str, keys: list) -> tuple[np.ndarray, list]:
        s = self.slots[group]
        s.check_new(keys)
        victims = s.victims(len(keys))
        if victims and self.on_victims is not None:
            self.on_victims(group, victims, np.array([s.slot(k) for k in victims], np.int64))
        return s.put(keys)

    def reserve(self, kind: str, keys) -> tuple[Claim, tuple]:
        """Host slots for entries arriving from a tier below, set aside (claimed) until the bytes
        are in: then adopt() (resident, in the LRU) or release_claim(). Returns (claim, keys the
        host LRU dropped to make room)."""
        g, keys = _group(kind), list(keys)
        _, evicted = self._make_room(g, keys)
        self.moves.evicted[g] += len(evicted)
        return Claim(kind=kind, keys=tuple(keys), slots=self.slots[g].claim(keys)), tuple(evicted)

    def adopt(self, claim: Claim) -> None:
        self.slots[_group(claim.kind)].unclaim(claim.keys, claim.slots)

    def release_claim(self, claim: Claim) -> None:
        self.slots[_group(claim.kind)].free_claimed(claim.slots)

    def _offload(self, group: str, keys: list, where) -> Offload:
        slots, evicted = self._make_room(group, keys)
        t = self._modeled(self._copy("host", group, slots, where), group, slots)
        m = self.moves
        m.bytes_to_host += t.nbytes
        m.moved_to_host[group] += len(keys)
        m.evicted[group] += len(evicted)
        self._track(t)
        return Offload(transfer=t, evicted=tuple(evicted))

    # ------------------------------------------------------------------ checks of input
    def _units(self, units, n: int, field: str) -> np.ndarray:
        arr = np.asarray(units, dtype=np.int64).reshape(-1) if len(units) else np.zeros(0, np.int64)
        if len(arr) != n:
            raise ConfigError(field, f"{len(arr)} units for {n} keys", "give one device unit per key")
        top = self.device_plan.num_full_pages
        if len(arr) and (arr.min() < 1 or arr.max() >= top):
            raise ConfigError(field, f"a page id lies outside 1..{top - 1}", "give full-page ids the allocator handed out")
        if len(np.unique(arr)) != len(arr):
            raise ConfigError(field, "a device page is given twice", "give each page once")
        return arr

    def _checkpoints(self, at, n: int) -> list[CheckpointAt]:
        at = list(at)
        if len(at) != n:
            raise ConfigError("at", f"{len(at)} checkpoint places for {n} keys", "give one CheckpointAt per key")
        plan = self.device_plan
        units = min((self.device_plan.buffer(s.buffer).units for b, s in self.plan.sources.items()
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
    def _modeled(self, t: Transfer, group: str, slots: np.ndarray) -> Transfer:
        """Stamp `t.modeled_s`: the H200-measured time of this move (the simulator's clock
        charges it, on either tier, so a CPU run models the same time as a GPU run)."""
        t.modeled_s = modeled_move_seconds(t.direction, self.plan, group, slots)
        self.modeled_seconds[t.direction] += t.modeled_s
        return t

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
            m = group_measures(self.plan, g, s.used, self.span_bytes)
            groups[GROUP_LABEL[g]] = HostGroupUsage(measures=m, units_total=s.units, units_used=s.used,
                                                    unit_bytes=self.plan.unit_bytes(g))
            total = m if total is None else total + m
        mv = self.moves
        return HostSnapshot(
            schema_version=HOST_LEDGER_SCHEMA_VERSION, pinned=self.pinned, copy_device=self.copy_device,
            totals=total, groups=groups, staging_device_bytes=self.staging_bytes,
            bytes_to_host=mv.bytes_to_host, bytes_to_device=mv.bytes_to_device,
            moved_to_host={GROUP_LABEL[g]: v for g, v in mv.moved_to_host.items()},
            moved_to_device={GROUP_LABEL[g]: v for g, v in mv.moved_to_device.items()},
            evicted={GROUP_LABEL[g]: v for g, v in mv.evicted.items()},
            dropped={GROUP_LABEL[g]: v for g, v in mv.dropped.items()},
            refused={GROUP_LABEL[g]: v for g, v in mv.refused.items()},
            restores_completed=mv.restores, restore_latency_sum_s=mv.restore_latency_sum_s,
            restore_latency_max_s=mv.restore_latency_max_s, transfers_in_flight=in_flight, hits=hits or {})

    def check_integrity(self) -> HostSnapshot:
        for s in self.slots.values():
            s.check_integrity()
        snap = self.snapshot()
        problems = []
        if self.memory_backed:      # a modeled tier holds no memory: its tensor bytes are 0
            problems = snap.totals.violations("host total")
            if self.tensor_bytes != self.plan.total_bytes:
                problems.append(f"host: planned {self.plan.total_bytes} != tensor {self.tensor_bytes}")
        if problems:
            raise IntegrityError("host ledger invariants broken: " + "; ".join(problems))
        return snap

    def close(self) -> None:
        self.synchronize()


def _group(kind: str) -> str:
    if kind not in KINDS:
        raise ConfigError("kind", f"{kind!r} is not a host entry kind", "use 'page' or 'checkpoint'")
    return KINDS[kind]
