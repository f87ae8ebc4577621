"""Host slots of one index space (host pages or host checkpoints) and their LRU order.

Slots come from a lowest-first free list, so a burst of evictions lands in consecutive slots
and a later restore of the same chain reads long contiguous runs (one copy per run and buffer).
Entries are keyed by whatever the caller uses for a cached page or checkpoint (the prefix
cache's node keys); the tier never interprets them.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..alloc.lowest import LowestFreeList
from ..errors import IntegrityError, PoolExhaustedError, RequestStateError


class HostSlots:
    def __init__(self, name: str, units: int) -> None:
        self.name = name
        self.units = units
        self._free = LowestFreeList(units + 1)   # ids 1..units; slot = id − 1
        self._lru: OrderedDict = OrderedDict()   # key -> slot, least recently used first
        self.claimed = 0                         # slots taken out of the LRU for a restore under way

    @property
    def used(self) -> int:
        return len(self._lru) + self.claimed

    @property
    def free(self) -> int:
        return self._free.free

    def __contains__(self, key) -> bool:
        return key in self._lru

    def slot(self, key) -> int:
        return self._lru[key]

    def keys(self) -> list:
        """Resident keys, least recently used first."""
        return list(self._lru)

    def check_new(self, keys) -> None:
        """Refuse, before any change, keys already resident, repeated, or more than fit at all."""
        if len(set(keys)) != len(keys):
            raise RequestStateError(f"{self.name}: a key is given twice; give each cached entry once")
        present = [k for k in keys if k in self._lru]
        if present:
            raise RequestStateError(f"{self.name}: {present[0]!r} is already in host memory; "
                                    "drop or restore it before moving it again")
        room = self.free + len(self._lru)     # claimed slots cannot be evicted
        if len(keys) > room:
            raise PoolExhaustedError(self.name, len(keys), room, "slots", "move to host")

    def check_resident(self, keys) -> None:
        if len(set(keys)) != len(keys):
            raise RequestStateError(f"{self.name}: a key is given twice; give each cached entry once")
        missing = [k for k in keys if k not in self._lru]
        if missing:
            raise RequestStateError(f"{self.name}: {missing[0]!r} is not in host memory; "
                                    "ask contains() before restoring")

    def victims(self, n: int) -> list:
        """The `n` least recently used keys: the ones put() evicts to make room for n more."""
        short = n - self._free.free
        if short <= 0:
            return []
        lru = iter(self._lru)
        return [next(lru) for _ in range(min(short, len(self._lru)))]

    def put(self, keys) -> tuple[np.ndarray, list]:
        """Slots for new keys (most recently used), evicting least recently used keys first
        when there is no room. Returns (slots, evicted keys). Call check_new first."""
        evicted = self.victims(len(keys))
        if evicted:
            self.take(evicted)
        slots = self._free.pop(len(keys), 0) - 1
        for k, s in zip(keys, slots.tolist()):
            self._lru[k] = s
        return slots, evicted

    def take(self, keys) -> np.ndarray:
        """Remove resident keys; their slots are free again. Returns the slots they held."""
        slots = np.fromiter((self._lru.pop(k) for k in keys), dtype=np.int64, count=len(keys))
        self._free.push(slots + 1)
        return slots

    def claim(self, keys) -> np.ndarray:
        """Take resident keys out of the LRU (no eviction can pick them) while their slots stay
        held; then free_claimed() once copied back, or unclaim() to keep them."""
        slots = np.fromiter((self._lru.pop(k) for k in keys), dtype=np.int64, count=len(keys))
        self.claimed += len(keys)
        return slots

    def free_claimed(self, slots: np.ndarray) -> None:
        self.claimed -= len(slots)
        self._free.push(slots + 1)

    def unclaim(self, keys, slots: np.ndarray) -> None:
        self.claimed -= len(slots)
        for k, s in zip(keys, slots.tolist()):
            self._lru[k] = s

    def touch(self, keys) -> None:
        for k in keys:
            self._lru.move_to_end(k)

    def check(self) -> list[str]:
        problems = self._free.check(self.name)
        slots = np.fromiter(self._lru.values(), dtype=np.int64, count=len(self._lru))
        if len(np.unique(slots)) != len(slots):
            problems.append(f"{self.name}: a host slot holds two entries")
        if self._free.used != len(slots) + self.claimed:
            problems.append(f"{self.name}: {self._free.used} slots held, {len(slots)} entries + {self.claimed} claimed")
        if len(slots) and not np.all(self._free.owner[slots + 1]):
            problems.append(f"{self.name}: an entry sits in a free slot")
        if self.used + self.free != self.units:
            problems.append(f"{self.name}: used {self.used} + free {self.free} != {self.units}")
        return problems

    def check_integrity(self) -> None:
        problems = self.check()
        if problems:
            raise IntegrityError("host slots broken: " + "; ".join(problems))
