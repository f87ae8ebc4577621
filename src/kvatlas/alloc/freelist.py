"""A stack of free unit ids in a numpy array: pop and push many at once, no Python loops."""

from __future__ import annotations

import numpy as np


class FreeList:
    """Ids 1..n-1 (0 is the null unit and never handed out). Fresh ids come out in ascending
    order; freed ids are reused first (LIFO), so live data stays where memory is already hot."""

    def __init__(self, units: int) -> None:
        self.capacity = max(units - 1, 0)
        # stack top at the end: reversed so that pop() yields 1, 2, 3, …
        self._stack = np.arange(units - 1, 0, -1, dtype=np.int64)
        self._top = self.capacity
        self.owner = np.zeros(max(units, 1), dtype=np.int64)  # request slot + 1 owning each id; 0 free

    @property
    def free(self) -> int:
        return self._top

    @property
    def used(self) -> int:
        return self.capacity - self._top

    def pop(self, n: int, owners: np.ndarray | int) -> np.ndarray:
        if n > self._top:
            raise RuntimeError(f"free list underflow: {n} > {self._top}")  # callers check first
        ids = self._stack[self._top - n:self._top][::-1].copy()
        self._top -= n
        self.owner[ids] = np.asarray(owners) + 1
        return ids

    def push(self, ids: np.ndarray) -> None:
        n = len(ids)
        if n == 0:
            return
        self.owner[ids] = 0
        self._stack[self._top:self._top + n] = ids[::-1]
        self._top += n

    def check(self, name: str) -> list[str]:
        free = self._stack[:self._top]
        problems = []
        if len(free) and (free.min() < 1 or free.max() > self.capacity):
            problems.append(f"{name}: a free id is out of range")
        elif len(free) != int(np.count_nonzero(np.bincount(free, minlength=1))):   # O(n), no hashing
            problems.append(f"{name}: an id is free twice")
        if np.any(self.owner[free] != 0):
            problems.append(f"{name}: a free id has an owner")
        if int(np.count_nonzero(self.owner[1:])) != self.used:
            problems.append(f"{name}: free {self.free} + used {np.count_nonzero(self.owner[1:])} != {self.capacity}")
        return problems
