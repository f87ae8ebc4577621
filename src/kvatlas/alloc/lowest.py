"""A free list that always hands out the lowest free ids: placement that keeps live data dense.

Used instead of FreeList when the arena backs memory lazily (the `vmm` backend): if every pop
takes the lowest free ids, live pages crowd the start of each buffer, so the chunks at the end
empty out as requests finish and can be unmapped. The LIFO FreeList would instead scatter a
long-running workload over every chunk it ever touched.

A bitmap plus a per-block count of free ids: finding the lowest n scans the block counts (one
int per 256 ids) and then only the few blocks holding the answer, so a pop costs a few µs
whatever the pool size. `peek(n)` answers without changing anything, so the allocator can ask
the backend to map the chunks of exactly those ids before it commits (checks before mutation).
"""

from __future__ import annotations

import numpy as np

_SHIFT = 8   # 256 ids per block


class LowestFreeList:
    """Ids 1..n-1 (0 is the null unit, never handed out). Same interface as FreeList, plus peek."""

    def __init__(self, units: int) -> None:
        n = max(units, 1)
        self.capacity = max(units - 1, 0)
        self.is_free = np.ones(n, dtype=bool)
        self.is_free[0] = False
        self.block_free = np.bincount(np.arange(1, n) >> _SHIFT, minlength=(n + 255) >> _SHIFT).astype(np.int64)
        self._free = self.capacity
        self._peeked: np.ndarray | None = None   # cached answer of the last peek, until a change
        self.owner = np.zeros(n, dtype=np.int64)  # request slot + 1 owning each id; 0 free

    @property
    def free(self) -> int:
        return self._free

    @property
    def used(self) -> int:
        return self.capacity - self._free

    def peek(self, n: int) -> np.ndarray:
        """The n ids the next pop(n) returns, ascending; changes nothing."""
        if n > self._free:
            raise RuntimeError(f"free list underflow: {n} > {self._free}")  # callers check first
        if self._peeked is not None and len(self._peeked) == n:
            return self._peeked
        if n == 0:
            return np.zeros(0, np.int64)
        blocks = np.flatnonzero(self.block_free)
        last = int(np.searchsorted(np.cumsum(self.block_free[blocks]), n))
        lo, hi = int(blocks[0]) << _SHIFT, (int(blocks[last]) + 1) << _SHIFT
        ids = np.flatnonzero(self.is_free[lo:hi])[:n] + lo
        self._peeked = ids
        return ids

    def pop(self, n: int, owners: np.ndarray | int) -> np.ndarray:
        ids = self.peek(n)
        if n == 0:
            return ids
        self._peeked = None
        self.is_free[ids] = False
        np.subtract.at(self.block_free, ids >> _SHIFT, 1)
        self._free -= n
        self.owner[ids] = np.asarray(owners) + 1
        return ids

    def push(self, ids: np.ndarray) -> None:
        if len(ids) == 0:
            return
        self._peeked = None
        self.owner[ids] = 0
        self.is_free[ids] = True
        np.add.at(self.block_free, ids >> _SHIFT, 1)
        self._free += len(ids)

    def live_ids(self) -> np.ndarray:
        return np.flatnonzero(self.owner)

    def check(self, name: str) -> list[str]:
        problems = []
        if self.is_free[0]:
            problems.append(f"{name}: the null id is free")
        if int(self.is_free.sum()) != self._free:
            problems.append(f"{name}: bitmap holds {int(self.is_free.sum())} free ids, counter {self._free}")
        counts = np.bincount(np.flatnonzero(self.is_free) >> _SHIFT, minlength=len(self.block_free))
        if not np.array_equal(counts, self.block_free):
            problems.append(f"{name}: block counts disagree with the bitmap")
        if np.any(self.owner[self.is_free] != 0):
            problems.append(f"{name}: a free id has an owner")
        if int(np.count_nonzero(self.owner[1:])) != self.used:
            problems.append(f"{name}: free {self.free} + used {np.count_nonzero(self.owner[1:])} != {self.capacity}")
        return problems
