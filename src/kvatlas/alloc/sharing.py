"""What the allocator knows of the prefix cache: pages held by the cache, reference counts, and
the resume rows saved at page boundaries. The tree, the keys and the policies live in
kvatlas.prefix; this mixin only hands out and takes back units.

- A page whose owner is CACHE_OWNER is held by the prefix cache, not by a request. `full_refs` /
  `swa_refs` count the running requests reading it (a shared page is read-only: a request only
  writes positions at or past the boundary it resumed from, which is a page boundary). A cached
  page with no reference is evictable.
- A request that resumes at boundary b starts with its first b / page_tokens full pages and the
  SWA pages of the window - 1 tokens before b taken from the cache (`admit(shared=...)`).
- Resume points. When a write touches the last `resume_tokens` positions before a boundary, the
  slot gets a checkpoint unit for that boundary and the WriteIndices name, per checkpoint buffer,
  which tokens' rows the caller must also save there (`checkpoint_rows`): the compressor-state
  rows of the C4 overlap, V4.1's window rows. They are saved as they are written, so any chunking
  and any rollback (the rewritten rows are saved again) leave the exact rows of the final
  sequence. The capture is committed when the forward pass that reached b is over (the next one
  begins, flush or finish): the SWA pages of the tail then pass to the cache (pinned by one
  reference while the capture is undecided) and `on_capture` (set by the prefix cache) decides.
- A released resume point whose SWA pages a running request still reads leaves them orphaned:
  freed when the last reader lets go.
"""

from __future__ import annotations

import numpy as np

from ..errors import KvatlasError, PoolExhaustedError
from ..planning.buffers import CHECKPOINTS, FULL_PAGES, SWA_PAGES
from ..units import cdiv
from .arrays import EMPTY, div, mod
from .entries import ratio_key

CACHE_OWNER = -1


class Sharing:
    def _init_sharing(self, plan, free_list) -> None:
        n = plan.num_request_slots
        units = plan.units.get(CHECKPOINTS, 0)
        self.prefix_on = units > 0
        self.full_refs = np.zeros(max(plan.num_full_pages, 1), np.int64)
        self.swa_refs = np.zeros(max(plan.num_swa_pages, 1), np.int64)
        self.swa_orphan = np.zeros(max(plan.num_swa_pages, 1), bool)
        self.full_shared = np.zeros(n, np.int64)   # leading table pages held by the cache
        self.swa_cached = np.zeros(n, np.int64)    # cache-held pages among the slot's SWA pages
        self.ckpt = free_list(units) if units else None
        self.ckpt_buffers = {b.name: b.entries_per_unit for b in plan.buffers if b.group == CHECKPOINTS}
        self.resume_tokens = max(self.ckpt_buffers.values(), default=0)
        self.tail_swa_pages = plan.sizing.checkpoint_swa_pages
        self.pending: dict[int, dict[int, int]] = {}   # slot -> boundary -> unit (0: not saved)
        # the decode path's fast lookups: each slot's latest pending boundary and its unit, and its
        # smallest pending boundary (numpy over a batch instead of a dict per token)
        self.pend_b = np.zeros(n, np.int64)
        self.pend_u = np.zeros(n, np.int64)
        self.pend_min = np.full(n, np.iinfo(np.int64).max, np.int64)
        self.on_capture = None                         # prefix cache: (slot, boundary, unit, swa_pages)
        self.on_need_checkpoint = None                 # prefix cache: free one unit by eviction, or False

    # ------------------------------------------------------------ resume rows in the write path
    def _checkpoint_rows(self, tok_slots, pos) -> dict:
        """Per checkpoint buffer: (token index, row in the buffer) of the rows to save."""
        P, k = self.P, self.resume_tokens
        if not k or not len(pos):
            return {}
        within = mod(pos, P)
        hit = np.flatnonzero(within >= P - k)
        if not len(hit):
            return {}
        boundary = (div(pos[hit], P) + 1) * P
        s = tok_slots[hit]
        units = np.where(self.pend_b[s] == boundary, self.pend_u[s], -1)
        miss = np.flatnonzero(units < 0)
        if len(miss):   # first touch of a boundary's tail (or an older pending one of a chunk)
            # a few per decode step: Python tuples beat np.unique; taken in (slot, boundary) order
            keys = list(zip(s[miss].tolist(), boundary[miss].tolist()))
            got = {q: self._pending_unit(*q) for q in sorted(set(keys))}
            units[miss] = [got[q] for q in keys]
        out = {}
        for name, rows in self.ckpt_buffers.items():
            off = pos[hit] - (boundary - rows)
            keep = (off >= 0) & (units > 0)
            out[name] = (hit[keep], units[keep] * rows + off[keep])
        return out

    def _pending_unit(self, slot: int, boundary: int) -> int:
        mine = self.pending.setdefault(slot, {})
        unit = mine.get(boundary)
        if unit is None:
            unit = mine[boundary] = self._take_checkpoint_unit(slot)
            if boundary > self.pend_b[slot]:
                self.pend_b[slot], self.pend_u[slot] = boundary, unit
            self.pend_min[slot] = min(int(self.pend_min[slot]), boundary)
        return unit

    def _take_checkpoint_unit(self, slot: int) -> int:
        """Best effort: a resume point not saved is a miss later, never a refused write."""
        if self.ckpt.free == 0 and not (self.on_need_checkpoint and self.on_need_checkpoint()):
            if self.ledger is not None:
                self.ledger.checkpoints_skipped += 1
            return 0
        if self.backing is not None:
            try:
                self.backing.acquire(((CHECKPOINTS, self.ckpt.peek(1)),))
            except PoolExhaustedError:
                return 0
        unit = int(self.ckpt.pop(1, 0)[0])
        self.ckpt.owner[unit] = CACHE_OWNER
        if self.ledger is not None:
            self.ledger.add_units(CHECKPOINTS, 1)
        return unit

    # ------------------------------------------------------------ commit: pass the tail to the cache
    def _commit_captures(self, slots=None) -> None:
        """The forward pass that wrote `slots` (None: every slot) is over: the resume points they
        reached are final (a slot not written cannot have reached a new one)."""
        if not self.pending:
            return
        reached = np.flatnonzero(self.pend_min <= self.length)   # a few slots per decode step
        if slots is not None:
            reached = np.intersect1d(reached, np.asarray(slots, np.int64))
        for slot in reached.tolist():
            mine = self.pending[slot]
            L = int(self.length[slot])
            for b in sorted(b for b in mine if b <= L):
                unit = mine.pop(b)
                if unit:
                    self._capture(slot, b, unit)
            self._pending_changed(slot)

    def _pending_changed(self, slot: int) -> None:
        mine = self.pending.get(slot)
        if not mine:
            self.pending.pop(slot, None)
            self.pend_b[slot] = self.pend_u[slot] = 0
            self.pend_min[slot] = np.iinfo(np.int64).max
            return
        self.pend_min[slot] = min(mine)
        if self.pend_b[slot] not in mine:
            last = max(mine)
            self.pend_b[slot], self.pend_u[slot] = last, mine[last]

    def _capture(self, slot: int, b: int, unit: int) -> None:
        pages = EMPTY
        if self.swa is not None:   # two pages: Python scalars beat numpy's per-call cost here
            lo = (b - (self.window - 1)) // self.Ps
            row, owner, refs = self.swa_table[slot], self.swa.owner, self.swa_refs
            ids = [int(row[j % self.ring]) for j in range(lo, b // self.Ps)]
            for page in ids:
                if owner[page] == slot + 1:
                    owner[page] = CACHE_OWNER
                    refs[page] += 1             # still in the slot's window
                    self.swa_cached[slot] += 1
                refs[page] += 1                 # the pin of an undecided capture
            pages = np.array(ids, np.int64)
        if self.on_capture is None:
            self.release_checkpoint(unit, pages, pinned=True)
        else:
            self.on_capture(slot, b, unit, pages)

    def unpin_checkpoint(self, pages) -> None:
        """A capture the cache keeps: drop its pin; pages read by no request become evictable."""
        self.swa_refs[pages] -= 1
        if self.ledger is not None:
            self.ledger.add_evictable(SWA_PAGES, int(np.count_nonzero(self.swa_refs[pages] == 0)))

    def release_checkpoint(self, unit: int, pages, pinned: bool = False) -> None:
        """Give a resume point back: its unit, and its SWA pages (orphaned while still read)."""
        refs, ids = self.swa_refs, pages.tolist()   # a tail of 1-3 distinct pages: Python scalars
        if pinned:                                   # beat a numpy call per line (~4 per decode step)
            for page in ids:
                refs[page] -= 1
        elif self.ledger is not None:
            self.ledger.add_evictable(SWA_PAGES, -sum(1 for page in ids if refs[page] == 0))
        idle = [page for page in ids if refs[page] == 0]
        for page in ids:
            if refs[page] > 0:
                self.swa_orphan[page] = True
        if idle:
            self._drop_cached_swa(np.array(idle, np.int64))
        self._free(self.ckpt, CHECKPOINTS, np.array([unit], np.int64))
        if self.ledger is not None:
            self.ledger.add_units(CHECKPOINTS, -1)

    def _drop_cached_swa(self, pages) -> None:
        if len(pages) == 0:
            return
        self.swa_orphan[pages] = False
        self._free(self.swa, SWA_PAGES, pages)
        if self.ledger is not None:
            self.ledger.add_units(SWA_PAGES, -len(pages))
            self.ledger.add_entries("swa", -len(pages) * self.Ps)

    def _unref_swa(self, slot_of_page, pages) -> np.ndarray:
        """Cache-held pages leaving requests' windows: one reference less each; orphans that
        nobody reads are freed. Returns the mask of `pages` that are cache-held."""
        cached = self.swa.owner[pages] == CACHE_OWNER
        if not cached.any():
            return cached
        p = pages[cached]
        np.subtract.at(self.swa_refs, p, 1)
        np.subtract.at(self.swa_cached, slot_of_page[cached], 1)
        zero = p[self.swa_refs[p] == 0]
        orphans = zero[self.swa_orphan[zero]]
        self._drop_cached_swa(orphans)
        if self.ledger is not None:
            self.ledger.add_evictable(SWA_PAGES, len(zero) - len(orphans))
        return cached

    # ------------------------------------------------------------ admission with a cached prefix
    def _attach(self, slot: int, shared) -> None:
        """Start `slot` at shared.boundary_tokens, reading the cache's pages."""
        b, full, swa = shared.boundary_tokens, np.asarray(shared.full_pages, np.int64), np.asarray(shared.swa_pages, np.int64)
        if self.full is not None:
            k = len(full)
            self.full_table[slot, :k] = full
            self.full_held[slot] = self.full_shared[slot] = k
            newly = full[self.full_refs[full] == 0]
            self.full_refs[full] += 1
            if self.ledger is not None:
                self.ledger.add_evictable(FULL_PAGES, -len(newly))
        if self.swa is not None and len(swa):
            lo = div(b - (self.window - 1), self.Ps)
            self.swa_table[slot, mod(np.arange(lo, lo + len(swa)), self.ring)] = swa
            self.swa_lo[slot], self.swa_hi[slot] = lo, lo + len(swa)
            if self.ledger is not None:
                self.ledger.add_evictable(SWA_PAGES, -int(np.count_nonzero(self.swa_refs[swa] == 0)))
            self.swa_refs[swa] += 1
            self.swa_cached[slot] = len(swa)
        self.length[slot] = b

    def check_shared(self, shared, total_tokens: int) -> None:
        b = shared.boundary_tokens
        if b % self.P or b >= total_tokens:
            raise KvatlasError(f"shared: boundary {b} is not a page boundary below the request's length")
        if self.full is not None and (len(shared.full_pages) != b // self.P
                                      or np.any(self.full.owner[shared.full_pages] != CACHE_OWNER)):
            raise KvatlasError("shared: full pages must be the cache's, one per page before the boundary")
        if self.swa is not None and len(shared.swa_pages) != self.tail_swa_pages:
            raise KvatlasError(f"shared: {len(shared.swa_pages)} SWA pages, the tail needs {self.tail_swa_pages}")

    # ------------------------------------------------------------ pages into the cache at finish
    def _keep_full(self, slot: int, cols) -> np.ndarray:
        """Hand the slot's private pages at table columns `cols` to the cache (evictable)."""
        cols = np.asarray(cols, np.int64)
        if not len(cols):
            return EMPTY
        pages = self.full_table[slot, cols].copy()
        if np.any(self.full.owner[pages] != slot + 1):
            raise KvatlasError("keep: a kept page is not the request's own")
        self.full.owner[pages] = CACHE_OWNER
        self.full_table[slot, cols] = 0
        if self.ledger is not None:
            for r in self.ratios:
                self.ledger.add_entries(ratio_key(r), len(pages) * (self.P // r))
            self.ledger.add_evictable(FULL_PAGES, len(pages))
        return pages

    def _unref_full(self, slot: int) -> None:
        k = int(self.full_shared[slot])
        if not k:
            return
        pages = self.full_table[slot, :k].copy()
        self.full_refs[pages] -= 1
        self.full_table[slot, :k] = 0
        if self.ledger is not None:
            self.ledger.add_evictable(FULL_PAGES, int(np.count_nonzero(self.full_refs[pages] == 0)))

    def evict_full(self, pages) -> None:
        """The cache drops pages no request reads."""
        pages = np.asarray(pages, np.int64)
        if np.any(self.full_refs[pages] != 0) or np.any(self.full.owner[pages] != CACHE_OWNER):
            raise KvatlasError("evict: a page is read by a running request or not the cache's")
        self._free(self.full, FULL_PAGES, pages)
        if self.ledger is not None:
            self.ledger.add_units(FULL_PAGES, -len(pages))
            self.ledger.add_evictable(FULL_PAGES, -len(pages))
            for r in self.ratios:
                self.ledger.add_entries(ratio_key(r), -len(pages) * (self.P // r))

    # ------------------------------------------------------------ storage for entries restored from a lower tier
    def take_cached_full(self, n: int) -> np.ndarray:
        """n full pages straight into the cache (their bytes come back from the host tier):
        complete, read by nobody, evictable. Refused with nothing changed when fewer are free."""
        free = self.free_full_pages()
        if n > free:
            raise PoolExhaustedError("full_pages", n, free, "pages", "restore cached pages")
        if self.backing is not None and n:
            self.backing.acquire(((FULL_PAGES, self.full.peek(n)),))
        pages = self.full.pop(n, 0)
        self.full.owner[pages] = CACHE_OWNER
        if self.ledger is not None:
            self.ledger.add_units(FULL_PAGES, n)
            self.ledger.add_evictable(FULL_PAGES, n)
            for r in self.ratios:
                self.ledger.add_entries(ratio_key(r), n * (self.P // r))
        return pages

    def take_cached_checkpoint(self) -> tuple[int, np.ndarray]:
        """A checkpoint unit and the tail's SWA pages, held by the cache (restored from a lower
        tier): (unit, SWA pages in logical order). Refused with nothing changed when none is free."""
        tail = self.tail_swa_pages if self.swa is not None else 0
        if self.ckpt.free < 1 or (tail and self.swa.free < tail):
            raise PoolExhaustedError("checkpoints", 1, self.ckpt.free, "units", "restore a resume point")
        if self.backing is not None:
            want = [(CHECKPOINTS, self.ckpt.peek(1))] + ([(SWA_PAGES, self.swa.peek(tail))] if tail else [])
            self.backing.acquire(tuple(want))
        unit = int(self.ckpt.pop(1, 0)[0])
        self.ckpt.owner[unit] = CACHE_OWNER
        pages = EMPTY
        if tail:
            pages = self.swa.pop(tail, 0)
            self.swa.owner[pages] = CACHE_OWNER
        if self.ledger is not None:
            self.ledger.add_units(CHECKPOINTS, 1)
            if tail:
                self.ledger.add_units(SWA_PAGES, tail)
                self.ledger.add_entries("swa", tail * self.Ps)
                self.ledger.add_evictable(SWA_PAGES, tail)
        return unit, pages

    def free_full_pages(self) -> int:
        """Full pages an admission may take now, before eviction."""
        return self.full.free - self.outstanding if self.full is not None else 0

    def _private_entries(self, slot: int, L: int) -> dict:
        """Entries a request's ledger share holds (not those of pages the cache holds)."""
        out = {ratio_key(r): L // r - int(self.full_shared[slot]) * (self.P // r) for r in self.ratios}
        if self.swa is not None:
            out["swa"] = L - (int(self.swa_lo[slot]) + int(self.swa_cached[slot])) * self.Ps
        return out

    def cached_swa_check(self, live) -> list[str]:
        """Integrity of the sharing arrays (called by alloc.integrity)."""
        out = []
        if self.full is not None:
            want = np.zeros_like(self.full_refs)
            for s in live:
                np.add.at(want, self.full_table[s, : self.full_shared[s]], 1)
            if not np.array_equal(want[1:], self.full_refs[1:]):
                out.append("full_pages: reference counts disagree with the requests' tables")
        if self.swa is not None:
            for s in live:
                held = self.swa_table[s, np.arange(self.swa_lo[s], self.swa_hi[s]) % self.ring]
                if int(np.count_nonzero(self.swa.owner[held] == CACHE_OWNER)) != self.swa_cached[s]:
                    out.append(f"slot {s}: cached SWA pages miscounted")
        if self.ckpt is not None:
            out += self.ckpt.check("checkpoints")
        return out
