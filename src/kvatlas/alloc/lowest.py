"""A free list that always hands out the lowest free ids: placement that keeps live data dense.

Used instead of FreeList when the arena backs memory lazily (the `vmm` backend): if every pop
takes the lowest free ids, live pages crowd the start of each buffer, so the chunks at the end
empty out as requests finish and can be unmapped. The LIFO FreeList would instead scatter a
long-running workload over every chunk it ever touched.

Free ids are three sets: every id from `top` up (never handed out, or given back from the top
down), `holes` (a sorted array of the free ids below top) and `recent` (ids given back since
the holes were last merged, unsorted). Lowest-first keeps the holes few: they are the first
ids handed out again. So a decode step's pop of 1-20 ids sorts at most the recent ids and the
first n holes, and push only appends; the recent ids are merged into the holes once there are
more than 64 + holes/64 of them (a merge costs about the holes' size, so its share per id
stays small however many holes there are). `peek(n)` answers without changing anything, so
the allocator can ask the backend to map the chunks of exactly those ids before it commits
(checks before mutation).
"""

from __future__ import annotations

import numpy as np

_EMPTY = np.zeros(0, np.int64)
_SORT_MERGE = 4096   # holes up to this many: merge by sorting; beyond: insert (linear)


class LowestFreeList:
    """Ids 1..n-1 (0 is the null unit, never handed out). Same interface as FreeList, plus peek."""

    def __init__(self, units: int) -> None:
        self._n = max(units, 1)
        self.capacity = max(units - 1, 0)
        self._top = 1            # every id in [top, n) is free
        self._holes = _EMPTY     # free ids below top, ascending
        self._recent: list[np.ndarray] = []   # ids given back since the last merge, any order
        self._num_recent = 0
        self._free = self.capacity
        self._peeked: np.ndarray | None = None   # cached answer of the last peek, until a change
        self._after = (0, _EMPTY)   # what pop(len(_peeked)) leaves: holes consumed, recent left
        self.owner = np.zeros(self._n, dtype=np.int64)  # request slot + 1 owning each id; 0 free

    @property
    def free(self) -> int:
        return self._free

    @property
    def used(self) -> int:
        return self.capacity - self._free

    @property
    def is_free(self) -> np.ndarray:
        """A bitmap of the free ids (built on demand: for checks and tests)."""
        bits = np.zeros(self._n, bool)
        bits[self._top:] = True
        bits[self._holes] = True
        for r in self._recent:
            bits[r] = True
        return bits

    def _recent_ids(self) -> np.ndarray:
        if len(self._recent) > 1:
            self._recent = [np.concatenate(self._recent)]
        return self._recent[0] if self._recent else _EMPTY

    def peek(self, n: int) -> np.ndarray:
        """The n ids the next pop(n) returns, ascending; changes nothing."""
        if n > self._free:
            raise RuntimeError(f"free list underflow: {n} > {self._free}")  # callers check first
        if self._peeked is not None and len(self._peeked) == n:
            return self._peeked
        if n == 0:
            return _EMPTY
        low = self._holes[:n]
        used, rest = len(low), _EMPTY
        if self._num_recent:   # the lowest n lie among the first n holes and the recent ids
            low = np.concatenate((low, self._recent_ids()))
            low.sort()
            low, rest = low[:n], low[n:]   # what is not taken stays free, as recent ids
        short = n - len(low)
        if short:              # every hole and recent id lies below top
            top = self._top
            low = np.concatenate((low, np.arange(top, top + short, dtype=np.int64))) if len(low) else \
                np.arange(top, top + short, dtype=np.int64)
        self._peeked, self._after = low, (used, rest)
        return low

    def pop(self, n: int, owners: np.ndarray | int) -> np.ndarray:
        ids = self.peek(n)
        if n == 0:
            return ids
        self._peeked = None
        last = int(ids[-1])
        used, rest = self._after
        if used:
            self._holes = self._holes[used:]
        if self._num_recent:
            self._recent = [rest] if len(rest) else []
            self._num_recent = len(rest)
        if last >= self._top:
            self._top = last + 1
        self._free -= n
        self.owner[ids] = np.asarray(owners) + 1
        return ids

    def push(self, ids: np.ndarray) -> None:
        if len(ids) == 0:
            return
        self._peeked = None
        self.owner[ids] = 0
        self._recent.append(ids)
        self._num_recent += len(ids)
        self._free += len(ids)
        if self._num_recent > 64 + (len(self._holes) >> 6):
            self._merge()

    def _merge(self) -> None:
        """Recent ids into the holes; then the holes that reach up to top become part of it."""
        r = self._recent_ids()
        self._recent, self._num_recent = [], 0
        h = self._holes
        if len(h) <= _SORT_MERGE:
            h = np.concatenate((h, r))
            h.sort()
        else:
            r = np.sort(r)
            h = np.insert(h, np.searchsorted(h, r), r)
        top = self._top
        if len(h) and int(h[-1]) == top - 1:
            # trailing holes top-k..top-1: the run where id + distance from the end == top - 1
            run = h[::-1] + np.arange(len(h), dtype=np.int64) == top - 1
            k = len(h) if run.all() else int(np.argmin(run))
            h, top = h[: len(h) - k], top - k
        self._holes, self._top = h, top

    def live_ids(self) -> np.ndarray:
        return np.flatnonzero(self.owner)

    def check(self, name: str) -> list[str]:
        problems = []
        h, r = self._holes, self._recent_ids()
        free = np.concatenate((h, r))
        if len(h) > 1 and np.any(np.diff(h) <= 0):
            problems.append(f"{name}: holes not strictly ascending")
        if len(free) and (free.min() < 1 or free.max() >= self._top):
            problems.append(f"{name}: a hole or recent id lies outside 1..top-1 ({self._top})")
        if len(np.unique(free)) != len(free):
            problems.append(f"{name}: an id is free twice")
        if self._num_recent != len(r) or self._free != len(free) + self._n - self._top:
            problems.append(f"{name}: free counter {self._free} disagrees with the free ids")
        if np.any(self.owner[free] != 0) or np.any(self.owner[self._top:] != 0):
            problems.append(f"{name}: a free id has an owner")
        if int(np.count_nonzero(self.owner[1:])) != self.used:
            problems.append(f"{name}: free {self.free} + used {np.count_nonzero(self.owner[1:])} != {self.capacity}")
        return problems
