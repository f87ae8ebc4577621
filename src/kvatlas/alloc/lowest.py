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
_BLOCK = 1 << _SHIFT
_SCAN = 32 * _BLOCK   # ids scanned in one go before visiting blocks one by one
_EMPTY = np.zeros(0, np.int64)


class LowestFreeList:
    """Ids 1..n-1 (0 is the null unit, never handed out). Same interface as FreeList, plus peek."""

    def __init__(self, units: int) -> None:
        n = max(units, 1)
        blocks = (n + _BLOCK - 1) >> _SHIFT
        self.capacity = max(units - 1, 0)
        self._bits = np.zeros(blocks << _SHIFT, dtype=bool)   # padded to whole blocks, pad never free
        self._bits[1:n] = True
        self.is_free = self._bits[:n]
        self._rows = self._bits.reshape(blocks, _BLOCK)
        self.block_free = self._rows.sum(axis=1, dtype=np.int64)
        self._hint = 0   # no block below this one has a free id
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
            return _EMPTY
        first = self._first_block()
        lo = first << _SHIFT
        if self.block_free[first] >= n:     # the usual case: the answer lies in one block
            ids = np.flatnonzero(self._rows[first])[:n] + lo
        else:                               # next: a short contiguous scan (a few µs)
            ids = np.flatnonzero(self._bits[lo:lo + _SCAN])[:n] + lo
            if len(ids) < n:
                ids = self._scattered(first, n)
        self._peeked = ids
        return ids

    def _scattered(self, first: int, n: int) -> np.ndarray:
        """The lowest n free ids when they spread over many blocks: visit only blocks with any."""
        blocks = np.flatnonzero(self.block_free[first:]) + first
        sel = blocks[: int(np.searchsorted(np.cumsum(self.block_free[blocks]), n)) + 1]
        idx = np.flatnonzero(self._rows[sel])[:n]
        return (sel[idx >> _SHIFT] << _SHIFT) + (idx & (_BLOCK - 1))

    def _first_block(self) -> int:
        """The lowest block holding a free id (callers ensure one exists)."""
        b = self._hint
        if self.block_free[b] == 0:
            b += int(np.flatnonzero(self.block_free[b:])[0])
            self._hint = b
        return b

    def pop(self, n: int, owners: np.ndarray | int) -> np.ndarray:
        ids = self.peek(n)
        if n == 0:
            return ids
        self._peeked = None
        self.is_free[ids] = False
        first, last = int(ids[0]) >> _SHIFT, int(ids[-1]) >> _SHIFT   # ids ascend
        if first == last:
            self.block_free[first] -= n
        else:
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
        self._hint = min(self._hint, int(ids.min()) >> _SHIFT)
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
