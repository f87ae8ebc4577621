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
        # pending resume points, one per slot in arrays (the decode path: numpy over a batch, no
        # dict per token): the slot's latest pending boundary (0: none) and its unit (0: not saved);
        # `older` holds the rare ones below it (one write that crossed several boundaries)
        self.pend_b = np.zeros(n, np.int64)
        self.pend_u = np.zeros(n, np.int64)
        self.older: dict[int, dict[int, int]] = {}
        self._reaching: list = []   # slots that wrote the last token before a pending boundary, this pass
        self._reached: list = []    # … in passes that are over: their captures are due, in one batch
        self._pass_tokens = 0       # the most tokens one request wrote in this pass
        self._defer_tokens = 0      # … summed over the passes since the oldest capture became due
        self._defer_limit = self._capture_deadline()
        self._tails_distinct = self.window - 1 <= self.P   # two tails never share a page
        self._tail_cols = np.arange(self.tail_swa_pages if self.swa is not None else 0, dtype=np.int64)
        groups: dict[int, list] = {}
        for name, rows in self.ckpt_buffers.items():
            groups.setdefault(rows, []).append(name)
        self._ckpt_groups = sorted(groups.items())
        self.on_capture = None        # prefix cache: (slots, boundaries, units, swa_pages[m, tail])
        self.on_need_checkpoint = None  # prefix cache: free one unit by eviction, or False
        self.on_slot_end = None       # prefix cache: a request it may know of leaves its slot

    def _capture_deadline(self) -> int:
        """Due captures wait and are made in one batch, as long as the tail pages they take stay in
        their request's window: a tail's first page retires once the request is `margin` tokens
        past the boundary. Waiting is capped at 32 tokens of progress (the units and SWA pages the
        waiting captures hold back are few, and a shortage of either makes them at once)."""
        if self.swa is None:
            return 32
        margin = (1 - self.tail_swa_pages) * self.Ps + self.window - 1
        return max(min(margin, 32), 1)

    # ------------------------------------------------------------ resume rows in the write path
    def _checkpoint_rows(self, tok_slots, pos, within) -> dict:
        """Per checkpoint buffer: (token index, row in the buffer) of the rows to save."""
        P, k = self.P, self.resume_tokens
        hit = (within >= P - k).nonzero()[0]
        if not len(hit):
            return {}
        s, w = tok_slots[hit], within[hit]
        bnd = pos[hit] + (P - w)
        units = self.pend_u[s]
        miss = self.pend_b[s] != bnd
        if miss.any():   # first touch of a boundary's tail (a few per decode step)
            units = self._touch(s, bnd, units, miss)
        last = w == P - 1
        if last.any():   # the boundary is reached when this pass is over (unless rolled back)
            self._reaching.append(s[last])
        out = {}
        for rows, names in self._ckpt_groups:
            off = w - (P - rows)
            ok = units > 0 if rows == k else (units > 0) & (off >= 0)
            got = (hit, units * rows + off) if ok.all() else (hit[ok], units[ok] * rows + off[ok])
            for name in names:
                out[name] = got
        return out

    def _touch(self, s, bnd, units, miss) -> np.ndarray:
        """Units for the tails first written now: popped at once when each is a fresh slot's only
        one (every decode step), else one by one in token order (chunks, drafts, rewrites)."""
        i = miss.nonzero()[0]
        ms, m = s[i], len(i)
        if (self.backing is None and self.ckpt.free >= m and not self.pend_b[ms].any()
                and (m == 1 or (ms[1:] != ms[:-1]).all())):   # a slot's tokens are adjacent
            got = self.ckpt.pop(m, CACHE_OWNER - 1)
            self.pend_b[ms], self.pend_u[ms] = bnd[i], got
            if self.ledger is not None:
                self.ledger.add_units(CHECKPOINTS, m)
            units[i] = got
            return units
        for j, slot, b in zip(i.tolist(), ms.tolist(), bnd[i].tolist()):
            units[j] = self._pending_unit(slot, b)
        return units

    def _pending_unit(self, slot: int, boundary: int) -> int:
        latest = int(self.pend_b[slot])
        if boundary == latest:
            return int(self.pend_u[slot])
        mine = self.older.get(slot, {})
        if boundary in mine:
            return mine[boundary]
        unit = self._take_checkpoint_unit(slot)
        if latest == 0:
            self.pend_b[slot], self.pend_u[slot] = boundary, unit
        elif boundary > latest:
            self.older.setdefault(slot, {})[latest] = int(self.pend_u[slot])
            self.pend_b[slot], self.pend_u[slot] = boundary, unit
        else:
            self.older.setdefault(slot, {})[boundary] = unit
        return unit

    def _take_checkpoint_unit(self, slot: int) -> int:
        """Best effort: a resume point not saved is a miss later, never a refused write."""
        if self.ckpt.free == 0 and self._reached:
            self._commit_captures()   # waiting captures hold units their decisions give back
        if self.ckpt.free == 0 and not (self.on_need_checkpoint and self.on_need_checkpoint()):
            if self.ledger is not None:
                self.ledger.checkpoints_skipped += 1
            return 0
        if self.backing is not None:
            try:
                self.backing.acquire(((CHECKPOINTS, self.ckpt.peek(1)),))
            except PoolExhaustedError:
                return 0
        unit = int(self.ckpt.pop(1, CACHE_OWNER - 1)[0])
        if self.ledger is not None:
            self.ledger.add_units(CHECKPOINTS, 1)
        return unit

    # ------------------------------------------------------------ commit: pass the tail to the cache
    def _pass_over(self, settle: bool) -> None:
        """A forward pass is over (called as the next begins): the boundaries it reached are final.
        Their captures are made in one batch once due (see _capture_deadline), or now if `settle`."""
        if self._reaching or self._reached:
            self._defer_tokens += self._pass_tokens
            self._reached += self._reaching
            self._reaching = []
        self._pass_tokens = 0
        if self._reached and (settle or self._defer_tokens >= self._defer_limit):
            self._commit_captures()

    def _commit_captures(self, slots=None) -> None:
        """Make the captures of the boundaries that `slots` (None: every slot whose pass is over)
        have reached: their tails pass to the cache and `on_capture` decides."""
        if slots is None:
            if not self._reached:
                return
            cand = np.unique(np.concatenate(self._reached))   # a slot may be listed more than once
            self._reached, self._defer_tokens = [], 0
        else:
            cand = np.asarray(slots, np.int64)
        L, b = self.length[cand], self.pend_b[cand]
        due = (b > 0) & (b <= L)
        if self.older:   # slots with several pending boundaries: in order, one at a time
            for slot in set(cand.tolist()) & self.older.keys():
                self._commit_older(slot, int(self.length[slot]))
            due &= self.pend_b[cand] > 0
        r = cand[due]
        if len(r):
            u = self.pend_u[r]
            self.pend_b[r] = self.pend_u[r] = 0
            self._capture(r, b[due], u)

    def _commit_older(self, slot: int, L: int) -> None:
        mine = self.older.pop(slot)
        for b in sorted(mine):
            if b <= L:
                self._capture(np.array([slot]), np.array([b]), np.array([mine.pop(b)]))
        if mine:
            self.older[slot] = mine
        latest = int(self.pend_b[slot])
        if 0 < latest <= L and not mine:
            u = np.array([self.pend_u[slot]])
            self.pend_b[slot] = self.pend_u[slot] = 0
            self._capture(np.array([slot]), np.array([latest]), u)

    def _capture(self, r, b, u) -> None:
        """Captures of distinct slots r at boundaries b with units u (0: not saved, skipped)."""
        saved = u > 0
        if not saved.all():
            r, b, u = r[saved], b[saved], u[saved]
            if not len(r):
                return
        pages = self._pin_tails(r, b)
        if self.on_capture is None:
            self.release_checkpoints(u, pages, pinned=True)
        else:
            self.on_capture(r, b, u, pages)

    def _pin_tails(self, r, b) -> np.ndarray:
        """The SWA pages of the window - 1 tokens before each boundary ([m, tail]): the request's
        own pass to the cache (still read by the request: one reference), and every one gets the
        pin of an undecided capture."""
        if self.swa is None:
            return np.zeros((len(r), 0), np.int64)
        rows = r[:, None]
        cols = mod(div(b, self.Ps)[:, None] - len(self._tail_cols) + self._tail_cols, self.ring)
        pages = self.swa_table[rows, cols]
        own = self.swa.owner[pages] == rows + 1
        pin = 1
        if own.any():
            self.swa.owner[pages[own]] = CACHE_OWNER
            self.swa_cached[r] += own.sum(axis=1)
            pin = own + 1
        if self._tails_distinct:
            self.swa_refs[pages] += pin
        else:
            np.add.at(self.swa_refs, pages, np.broadcast_to(pin, pages.shape))
        return pages

    def unpin_checkpoint(self, pages) -> None:
        """A capture the cache keeps: drop its pin; pages read by no request become evictable."""
        self.swa_refs[pages] -= 1
        if self.ledger is not None:
            self.ledger.add_evictable(SWA_PAGES, int(np.count_nonzero(self.swa_refs[pages] == 0)))

    def release_checkpoint(self, unit: int, pages, pinned: bool = False) -> None:
        self.release_checkpoints(np.array([unit], np.int64), np.asarray(pages, np.int64)[None], pinned)

    def release_checkpoints(self, units, pages, pinned: bool = False) -> None:
        """Give resume points back: their units, and their SWA pages ([m, tail]; orphaned while a
        request still reads them). `pinned`: captures not yet kept, each holding one pin."""
        ids = pages.ravel()
        if len(ids):
            refs = self.swa_refs
            if pinned:
                if self._tails_distinct:
                    refs[ids] -= 1
                else:
                    np.subtract.at(refs, ids, 1)
            elif self.ledger is not None:   # kept ones: their idle pages were counted evictable
                self.ledger.add_evictable(SWA_PAGES, -int(np.count_nonzero(refs[ids] == 0)))
            idle = refs[ids] == 0
            if not idle.all():
                self.swa_orphan[ids[~idle]] = True
            if idle.any():
                gone = ids[idle]
                self._drop_cached_swa(gone if self._tails_distinct else np.unique(gone))
        self._free(self.ckpt, CHECKPOINTS, units)
        if self.ledger is not None:
            self.ledger.add_units(CHECKPOINTS, -len(units))

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
