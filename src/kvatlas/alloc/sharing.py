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
  slot has a checkpoint unit for that boundary and the WriteIndices name, per checkpoint buffer,
  which tokens' rows the caller must also save there (`checkpoint_rows`): the compressor-state
  rows of the C4 overlap, V4.1's window rows. They are saved as they are written, so any chunking
  and any rollback (the rewritten rows are saved again) leave the exact rows of the final
  sequence.
- The decode step's cost. The bookkeeping of resume points runs as an upkeep every
  `_defer_limit` tokens of progress (at once for a flush, a finish or a shortage of units or SWA
  pages), in batches over every slot, so a decode step pays one comparison over the batch and a
  gather and an add for its resume rows: the upkeep makes the captures that are due (boundaries
  reached in passes that are over: their SWA tails pass to the cache, pinned while undecided, and
  `on_capture`, set by the prefix cache, decides them together) and takes units ahead for the
  tails the running requests reach before the next upkeep (`row_base`). The interval is as long
  as the spare units cover, up to when a tail's first page could retire (63 tokens for V4), so
  no capture ever misses its tail. Progress is counted per pass as the most tokens one request
  wrote (in a grouped pass, the sum of its writes'), which bounds every request's. A steady
  batch (the same one stepping one token per request, nothing else in between) skips even the
  comparison: its tokens reach their tails on a schedule made once every page_tokens - k steps
  (_Schedule), whose rows follow every change of `row_base` (an upkeep's units, a unit a tail
  took as it was first written, a capture made).
- A released resume point whose SWA pages a running request still reads leaves them orphaned:
  freed when the last reader lets go.
"""

from __future__ import annotations

import numpy as np

from ..errors import KvatlasError, PoolExhaustedError
from ..planning.buffers import CHECKPOINTS, FULL_PAGES, SWA_PAGES
from ..units import cdiv
from .arrays import EMPTY, div, mod, spread
from .entries import ratio_key

CACHE_OWNER = -1
NO_ROW = -(1 << 62)   # row_base of a slot with no unit for its next tail: any row from it is < 0


class Sharing:
    def _init_sharing(self, plan, free_list) -> None:
        n = plan.num_request_slots
        units = plan.units.get(CHECKPOINTS, 0)
        self.prefix_on = units > 0
        self.full_refs = np.zeros(max(plan.num_full_pages, 1), np.int64)
        self.swa_refs = np.zeros(max(plan.num_swa_pages, 1), np.int64)
        self.swa_orphan = np.zeros(max(plan.num_swa_pages, 1), bool)
        self.full_shared = np.zeros(n, np.int64)   # leading table pages held by the cache
        self.ckpt = free_list(units) if units else None
        self.ckpt_buffers = {b.name: b.entries_per_unit for b in plan.buffers if b.group == CHECKPOINTS}
        self.resume_tokens = max(self.ckpt_buffers.values(), default=0)
        self.tail_swa_pages = plan.sizing.checkpoint_swa_pages
        # pending resume points, one per slot in arrays (the decode path: numpy over a batch, no
        # dict per token): the slot's latest pending boundary (0: none), its unit (0: not saved)
        # and, for the decode path, the row of position 0 in it (row = row_base + position; NO_ROW
        # when none); `older` holds the rare ones below it (one write that crossed several)
        self.pend_b = np.zeros(n, np.int64)
        self.pend_u = np.zeros(n, np.int64)
        self.row_base = np.full(n, NO_ROW, np.int64)
        self.older: dict[int, dict[int, int]] = {}
        # the most tokens one request wrote in this pass (in a grouped pass, where one request
        # may be written more than once, the sum of the writes' most: a bound all the same)
        self._pass_tokens = 0
        self._defer_tokens = 0      # … summed over the passes since the last upkeep
        self._interval_most = self._upkeep_interval()
        self._defer_limit = min(self._interval_most, 32)   # until units are taken ahead (_take_ahead)
        # units are taken ahead for tails that start within the next interval's progress, one
        # step's tokens more: a tail `ahead` tokens from its boundary needs one within interval I
        # when ahead <= I + _ahead_slack
        self._ahead_slack = self.resume_tokens + 1 + plan.options.draft_tokens
        self._unit_reserve = plan.options.chunked_prefill_tokens // self.P + 1
        self._last_boundary = self.max_len // self.P * self.P   # the last one a request can reach
        self._tails_distinct = self.window - 1 <= self.P   # two tails never share a page
        self._windowed_cached = 0   # cache-held SWA pages in requests' windows, one per window
        self._tail_cols = np.arange(self.tail_swa_pages if self.swa is not None else 0, dtype=np.int64)[:, None]
        groups: dict[int, list] = {}
        for name, rows in self.ckpt_buffers.items():
            groups.setdefault(rows, []).append(name)
        self._ckpt_groups = sorted(groups.items())
        self._one_group = len(groups) == 1 and self.resume_tokens in groups   # every buffer saves k rows
        self._tail_start = np.int64(self.P - self.resume_tokens)   # (a numpy scalar compares faster)
        # the most progress since the last upkeep for which a write takes the decode path of
        # _checkpoint_rows: below it no request can have passed its pending boundary and reached
        # the next one's tail, so row_base is the unit of the tail its tokens are in, or NO_ROW
        self._fast_most = self.P - self.resume_tokens if self._one_group else -1
        self._writes = 0              # writes and rollbacks so far (a steady batch's schedule checks it)
        self._steady = None           # (batch array, epoch, write number) of the last one-token step
        self._schedule = None         # _Schedule of that batch's resume rows; None when row_base changes
        self._passes = 0              # forward passes begun (a pass short of units spares them once)
        self._spared = None           # (pass, epoch) of the last spare (_take_checkpoint_unit)
        self._no_eviction = None      # (pass, epoch) in which the cache had no resume point to evict
        self.on_capture = None        # prefix cache: (slots, boundaries, units, swa_pages[tail, m])
        self.on_need_checkpoint = None  # prefix cache: free one unit by eviction, or False
        self.on_need_physical = None    # prefix cache: (tries, refusal) → evicted for physical memory (vmm cap), or False
        self.on_slot_end = None       # prefix cache: a request it may know of leaves its slot
        self.on_pass_over = None      # prefix cache: a pass is over, its pages committed (None: nothing to share)

    def _upkeep_interval(self) -> int:
        """The most tokens of progress between two upkeeps (_upkeep): due captures wait for it, as
        long as the tail pages they take stay in their request's window (a tail's first page
        retires once the request is `margin` tokens past the boundary; 63 for V4). Each upkeep
        then sets the next interval from the units it has (_take_ahead)."""
        if self.swa is None:
            return 64
        return max((1 - self.tail_swa_pages) * self.Ps + self.window - 1, 1)

    # ------------------------------------------------------------ resume rows in the write path
    def _checkpoint_rows(self, tok_slots, pos, within, progress: int, batch=None) -> dict:
        """Per checkpoint buffer: (token index, row in the buffer) of the rows to save. progress:
        the most tokens any request has written since the last upkeep, this write's included;
        batch: the slots array of a one-token decode step (its tokens are in that order)."""
        if batch is not None and progress <= self._fast_most:
            sched = self._schedule
            if (sched is not None and sched.batch is batch and sched.writes == self._writes - 1
                    and sched.epoch == self._epoch and sched.t + 1 < sched.horizon):
                # (_steady_rows and the common case of _scheduled_rows, inline: every step of a
                # steady batch comes here)
                sched.writes += 1
                sched.t = t = sched.t + 1
                lo, hi = sched.lo[t], sched.hi[t]
                if lo == hi:
                    return {}
                rows = sched.rows[lo:hi] + t
                if rows[rows.argmin()] >= 0:
                    return dict.fromkeys(self.ckpt_buffers, (sched.order[lo:hi], rows))
                return self._scheduled_rows(sched, t, rows)
            got = self._steady_rows(batch, tok_slots, pos, within)
            if got is not None:
                return got
        hit = (within >= self._tail_start).nonzero()[0]
        if not len(hit):
            return {}
        if progress <= self._fast_most:
            # a decode step: each request's tokens meet one tail at most, and its unit was taken
            # ahead (_take_ahead), unless the request got there faster (NO_ROW: the general path).
            # (Numpy calls cost several µs each inside a step, whatever their size: the rows of the
            # whole batch, then the hits, is one call fewer than gathering slots first.)
            rows = self.row_base.take(tok_slots)
            rows += pos
            rows = rows.take(hit)
            if rows[rows.argmin()] >= 0:   # (argmin: a fraction of min()'s cost on a few values)
                return dict.fromkeys(self.ckpt_buffers, (hit, rows))
        s = tok_slots.take(hit)
        P, k = self.P, self.resume_tokens
        w = within[hit]
        bnd = pos[hit] + (P - w)
        units = self.pend_u[s]
        miss = self.pend_b[s] != bnd
        if miss.any():   # first touch of a boundary's tail (a few per decode step)
            units = self._touch(s, bnd, units, miss)
        out = {}
        for rows, names in self._ckpt_groups:
            off = w - (P - rows)
            ok = units > 0 if rows == k else (units > 0) & (off >= 0)
            got = (hit, units * rows + off) if ok.all() else (hit[ok], units[ok] * rows + off[ok])
            for name in names:
                out[name] = got
        return out

    def _steady_rows(self, batch, tok_slots, pos, within):
        """A steady batch: the same slots array stepping one token per request, nothing else
        written, rolled back, admitted or finished in between. Its tokens then reach their tails
        on a known schedule, made once per page of progress (_Schedule), so a step's resume rows
        cost one slice and one add instead of a comparison over the whole batch. None: no
        schedule (the caller scans)."""
        w, epoch = self._writes, self._epoch
        sched = self._schedule
        if sched is not None and sched.batch is batch and sched.epoch == epoch and sched.writes == w - 1:
            sched.writes = w
            sched.t += 1
            if sched.t < sched.horizon:
                return self._scheduled_rows(sched, sched.t)
            self._schedule = None
        last, self._steady = self._steady, (batch, epoch, w)
        if last is None or last[0] is not batch or last[1] != epoch or last[2] != w - 1:
            return None   # a schedule pays off from the second step of the same batch on
        self._schedule = sched = _Schedule.make(self, batch, tok_slots, pos, within, epoch, w)
        return self._scheduled_rows(sched, 0)

    def _scheduled_rows(self, sched, t: int, rows=None) -> dict:
        """The step's resume rows from the schedule. Its tokens first in a tail that has no unit
        yet (more running requests than units taken ahead) take one as on the general path
        (_touch, in token order: they share one e, so their run is in token order), which
        patches the schedule's rows; a token that gets none saves no row, nor do its tail's
        later tokens (its pending boundary says so: only the first touch takes a unit)."""
        lo, hi = sched.lo[t], sched.hi[t]
        if lo == hi:
            return {}
        if rows is None:   # (else the caller's: sched.rows[lo:hi] + t)
            rows = sched.rows[lo:hi] + t
        order = sched.order[lo:hi]
        if rows[rows.argmin()] < 0:
            new = 0 if t == 0 else max(sched.hi[t - 1] - lo, 0)   # (tokens first in their tail now)
            bad = (rows[new:] < 0).nonzero()[0] + new
            if len(bad):
                P, k = self.P, self.resume_tokens
                s = sched.slots[lo:hi].take(bad)
                p = sched.pos[lo:hi].take(bad) + t
                w = mod(p, P)
                bnd = p + (P - w)
                units, miss = self.pend_u.take(s), self.pend_b.take(s) != bnd
                if miss.any():
                    units = self._touch(s, bnd, units, miss)
                    rows[bad] = np.where(units > 0, units * k + (w - (P - k)), -1)
                    if self.older:   # (a unit kept aside, not in row_base: the scan finds it, the schedule not)
                        self._schedule = None
            ok = rows >= 0
            order, rows = order[ok], rows[ok]
            if not len(rows):
                return {}
        return dict.fromkeys(self.ckpt_buffers, (order, rows))

    def _touch(self, s, bnd, units, miss) -> np.ndarray:
        """Units for the tails first written now: popped at once when each is a fresh slot's only
        one (every decode step), else one by one in token order (chunks, drafts, rewrites)."""
        i = miss.nonzero()[0]
        ms, m = s[i], len(i)
        free = self.ckpt.free
        if (free and self.backing is None and not self.pend_b[ms].any()
                and (m == 1 or (ms[1:] != ms[:-1]).all())):   # a slot's tokens are adjacent
            # fresh slots' only tails: the first `free` of them take a unit each in one pop (what
            # one pop each, in token order, would give); the rest, if any, go on below with none
            # free, where the first of them spares units or evicts
            f = min(free, m)
            got = self.ckpt.pop(f, CACHE_OWNER - 1)
            if self.ledger is not None:
                self.ledger.add_units(CHECKPOINTS, f)
            if f == m:
                self._set_pending(ms, bnd[i], got)
                units[i] = got
                return units
            self._set_pending(ms[:f], bnd[i[:f]], got)
            units[i[:f]] = got
            i, ms = i[f:], ms[f:]
        now = (self._passes, self._epoch)
        for n, (j, slot, b) in enumerate(zip(i.tolist(), ms.tolist(), bnd[i].tolist())):
            if self.ckpt.free == 0 and self._spared == now and self._no_eviction == now and not self.older:
                # none can come within this pass (spared, nothing to evict: _take_checkpoint_unit),
                # so the rest get none: noted as _pending_unit notes each, in one call when they
                # are fresh slots' only tails (more running requests than units: every step)
                rest = ms[n:]
                if not self.pend_b[rest].any() and (len(rest) == 1 or (rest[1:] != rest[:-1]).all()):
                    self._set_pending(rest, bnd[i[n:]], 0)
                    if self.ledger is not None:
                        self.ledger.checkpoints_skipped += len(rest)
                    units[i[n:]] = 0
                    break
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
        latest = int(self.pend_b[slot])   # (as it stands after taking the unit)
        if latest == 0:
            self._set_pending(slot, boundary, unit)
        elif boundary > latest:
            self.older.setdefault(slot, {})[latest] = int(self.pend_u[slot])
            self._set_pending(slot, boundary, unit)
        else:
            self.older.setdefault(slot, {})[boundary] = unit
        return unit

    def _set_pending(self, slots, boundaries, units) -> None:
        """units: one per slot, or one int for all (0: none saved)."""
        self.pend_b[slots], self.pend_u[slots] = boundaries, units
        k = self.resume_tokens
        if isinstance(slots, int) or not isinstance(units, np.ndarray):   # (scalars: no per-call numpy costs)
            base = units * k - (boundaries - k) if units > 0 else NO_ROW
        else:
            base = units * k - (boundaries - k)
            if not units[units.argmin()]:   # (units popped are all > 0: most calls)
                base = np.where(units > 0, base, NO_ROW)
        self.row_base[slots] = base
        if self._schedule is not None:   # (every change of row_base reaches a steady batch's schedule)
            self._schedule.patch(slots, self.row_base)

    def _clear_pending(self, slots) -> None:
        self.pend_b[slots] = self.pend_u[slots] = 0
        self.row_base[slots] = NO_ROW
        if self._schedule is not None:
            self._schedule.patch(slots, self.row_base)

    def _take_checkpoint_unit(self, slot: int) -> int:
        """Best effort: a resume point not saved is a miss later, never a refused write. Within
        one pass and epoch, sparing units again finds nothing the last try did not (the slots it
        looks at are those not written in the pass, and they do not change), so a pass short of
        units spares once, not once per missing unit: the step stays linear in running requests."""
        if self.ckpt.free == 0:
            now = (self._passes, self._epoch)
            if self._spared != now:
                self._spared = now
                self.spare_checkpoint_units()
            if self.ckpt.free == 0 and self._no_eviction != now \
                    and not (self.on_need_checkpoint and self.on_need_checkpoint()):
                self._no_eviction = now   # (likewise: nothing the cache could evict appears within the pass)
        if self.ckpt.free == 0:
            if self.ledger is not None:
                self.ledger.checkpoints_skipped += 1
            return 0
        if self.backing is not None:
            try:   # (out of physical memory, the cache evicts for it as for any unit: _back)
                self._back(lambda: ((CHECKPOINTS, self.ckpt.peek(1)),))
            except PoolExhaustedError:
                return 0
        unit = int(self.ckpt.pop(1, CACHE_OWNER - 1)[0])
        if self.ledger is not None:
            self.ledger.add_units(CHECKPOINTS, 1)
        return unit

    # ------------------------------------------------------------ commit: pass the tail to the cache
    def _upkeep(self) -> None:
        """Every `_defer_limit` tokens of progress (see _begin_forward), or at a flush: make the
        captures that are due, then take units ahead for the coming tails."""
        self._defer_tokens = 0
        self._commit_captures()
        self._take_ahead()

    def spare_checkpoint_units(self) -> int:
        """Units short: make the due captures (their decisions give units back) and return the
        units taken ahead for tails nobody has written yet. Returns the free units."""
        w = self._written
        # (a pass that wrote every running request leaves no capture to commit outside it: free
        # slots pend nothing, as the integrity check verifies)
        if not (len(w) == 1 and len(w[0]) == len(self.slot_of)):
            self._commit_captures(passed_only=True)
        idle = ((self.pend_b > 0) & (self.length <= self.pend_b - self.resume_tokens)).nonzero()[0]
        idle = idle[[s not in self.older for s in idle.tolist()]] if self.older else idle
        if len(idle):
            units = self.pend_u[idle]
            self._clear_pending(idle)
            units = units[units > 0]
            self._free(self.ckpt, CHECKPOINTS, units)
            if self.ledger is not None:
                self.ledger.add_units(CHECKPOINTS, -len(units))
        return self.ckpt.free

    def _take_ahead(self) -> None:
        """Units for the tails that running requests will start writing before the next upkeep,
        so a decode step finds its rows in row_base without taking units itself; and the next
        interval: the longest (up to _interval_most) whose tails the spare units cover, since
        an upkeep costs about as much for few captures as for many. Short of units, the nearest
        tails get them and the interval shrinks to reach no further (never below 16 tokens: past
        that, the few uncovered tails take units as they are written)."""
        if not self._one_group or self.backing is not None:
            self._defer_limit = min(self._interval_most, 32)
            return
        most, slack = self._interval_most, self._ahead_slack
        spare = max(self.ckpt.free - self._unit_reserve, 0)
        L, P, k = self.length, self.P, self.resume_tokens
        # tokens before the next boundary's tail starts (a free slot: page_tokens - k; negative
        # in the tail: the request is writing it, its unit was taken already or is taken then)
        before = (P - k) - mod(L, P)
        want = (before.view(np.uint64) <= most + slack - k) & (L < self._last_boundary)
        want = (want & (self.pend_b == 0)).nonzero()[0]
        interval = most
        if len(want) > spare:
            ahead = before.take(want)   # (0 .. most + slack - k: 16 bits, a radix sort)
            if spare:
                near = want[np.argsort(ahead.astype(np.int16) if most + slack < 1 << 15 else ahead, kind="stable")]
                want, first = near[:spare], near[spare]
            else:   # (none to give: only the nearest tail sets the interval)
                want, first = want[:0], want[ahead.argmin()]
            interval = max(int(before[first]) + k - slack - 1, min(16, most))
        self._defer_limit = interval
        if len(want):
            self._set_pending(want, L.take(want) + before.take(want) + k,   # the next boundary
                              self.ckpt.pop(len(want), CACHE_OWNER - 1))
            if self.ledger is not None:
                self.ledger.add_units(CHECKPOINTS, len(want))

    def _commit_captures(self, slots=None, passed_only: bool = False) -> None:
        """Make the captures of the boundaries that `slots` (None: every slot) have reached in
        passes that are over: their tails pass to the cache and `on_capture` decides.
        passed_only: called within a pass (units or SWA pages short), so the slots written in it
        are left out: what their writes reached may still be rewritten (a rollback), and the
        rows of this write are not saved yet."""
        others = None
        if passed_only and self._written and slots is None:
            others = np.ones(len(self.pend_b), bool)   # (a mask: linear, where a set difference sorts)
            for w in self._written:
                others[w] = False
        cand = np.asarray(slots, np.int64) if slots is not None else None
        b = self.pend_b if cand is None else self.pend_b[cand]
        L = self.length if cand is None else self.length[cand]
        due = (b <= L) & b.astype(bool)
        if others is not None:
            due &= others
        if self.older:   # slots with several pending boundaries: in order, one at a time
            if others is not None:   # (the slots not written in this pass)
                olds = set(others.nonzero()[0].tolist()) & self.older.keys()
            else:
                olds = list(self.older) if cand is None else set(cand.tolist()) & self.older.keys()
            for slot in olds:
                self._commit_older(slot, int(self.length[slot]))
            due &= (self.pend_b if cand is None else self.pend_b[cand]).astype(bool)
        i = due.nonzero()[0]
        if len(i):
            r = i if cand is None else cand[i]
            bb, u = self.pend_b[r], self.pend_u[r]
            self._clear_pending(r)
            self._capture(r, bb, u)

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
            self._clear_pending(slot)
            self._capture(np.array([slot]), np.array([latest]), u)

    def _capture(self, r, b, u) -> None:
        """Captures of distinct slots r at boundaries b with units u (0: not saved, skipped)."""
        if not u[u.argmin()]:   # (argmin: cheaper than all() on a few values)
            saved = u > 0
            r, b, u = r[saved], b[saved], u[saved]
            if not len(r):
                return
        pages = self._pin_tails(r, b)
        if self.on_capture is None:
            self.release_checkpoints(u, pages, pinned=True)
        else:
            self.on_capture(r, b, u, pages)

    def _pin_tails(self, r, b) -> np.ndarray:
        """The SWA pages of the window - 1 tokens before each boundary ([tail, m]: row j holds
        each tail's j-th page) pass to the cache, each pinned by the undecided capture. A
        request's own tail, right behind its retired pages (every decode step's case), leaves its
        window's bookkeeping at once: swa_lo moves past it, so retiring never meets it again. The
        request still reads it, with no reference counted, which is safe: the earliest this
        capture can be dropped is at the request's next boundary, page_tokens >= window - 1 tokens
        on, when the tail has left its window (a capture decided sooner, kept at once or read by
        another request, puts the tail back in the window with a reference: keep_own_tail). Otherwise (a page it shares, older pages it still
        holds) the tail stays in its window with a reference for it, as shared pages do, until
        retired. (One take from the flat table with a [tail, m] index: a 2-D fancy index into
        the table costs several times more on a batch this size, and this runs every upkeep.)"""
        T = len(self._tail_cols)
        if not T:
            return np.empty((0, len(r)), np.int64)
        lo = div(b, self.Ps) - T
        pages = self.swa_table.ravel().take(mod(self._tail_cols + lo, self.ring) + r * self.ring)
        owner, mine = self.swa.owner, r + 1
        own = owner.take(pages) == mine
        if self._tails_distinct and not np.count_nonzero(self.swa_lo.take(r) != lo) + own.size - np.count_nonzero(own):
            # the common case: every tail the request's own, leaving
            owner[pages] = CACHE_OWNER
            self.swa_lo[r] = lo + T
            self.swa_refs[pages] += 1
            return pages
        own = own.all(axis=0)
        leave = own & (self.swa_lo.take(r) == lo) if self._tails_distinct else np.zeros(len(r), bool)
        each = pages.T   # [m, tail]: the general case, rare
        own = owner[each] == mine[:, None]
        owner[each[own]] = CACHE_OWNER
        stay = own & ~leave[:, None]
        self.swa_lo[r[leave]] = lo[leave] + T
        self._windowed_cached += int(np.count_nonzero(stay))
        if self._tails_distinct:
            self.swa_refs[each] += stay + 1
        else:
            np.add.at(self.swa_refs, each, stay + 1)
        return pages

    def keep_own_tail(self, slot: int, boundary: int, pages) -> None:
        """A capture of `slot` at `boundary` is decided while its request may still read its
        tail (kept at once, or read by another request, before the request reaches its next
        boundary). If the tail left the window's bookkeeping when captured (_pin_tails' common
        case, whose safety rests on no decision coming before that next boundary), it rejoins
        the window with a reference for the request, as a shared prefix's pages are held: no
        eviction or drop of the point can then free a page the request still reads, and
        retiring lets go of them. Nothing to do once its window is past the tail."""
        T = len(self._tail_cols)
        if not T or not self._tails_distinct:   # (not distinct: the tail never left the window)
            return
        lo = int(boundary) // self.Ps - T
        if int(self.swa_lo[slot]) != lo + T or (int(self.length[slot]) - (self.window - 1)) // self.Ps >= lo + T:
            return
        pages = np.asarray(pages, np.int64)
        if self.swa_table[slot].take(self._tail_cols[:, 0] + lo, mode="wrap").tolist() != pages.tolist():
            return
        self.swa_lo[slot] = lo
        self.swa_refs[pages] += 1
        self._windowed_cached += T

    def unpin_checkpoint(self, pages) -> None:
        """A capture the cache keeps: drop its pin; pages read by no request become evictable."""
        self.swa_refs[pages] -= 1
        if self.ledger is not None:
            self.ledger.add_evictable(SWA_PAGES, int(np.count_nonzero(self.swa_refs[pages] == 0)))

    def release_checkpoint(self, unit: int, pages, pinned: bool = False) -> None:
        self.release_checkpoints(np.array([unit], np.int64), np.asarray(pages, np.int64), pinned)

    def release_checkpoints(self, units, pages, pinned: bool = False) -> None:
        """Give resume points back: their units, and their SWA pages (any shape; orphaned while a
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
            left = refs[ids]
            if not left[left.argmax()]:   # every page idle (a decode step's dropped tails)
                gone = ids
            else:
                idle = left == 0
                self.swa_orphan[ids[~idle]] = True
                gone = ids[idle]
            if len(gone):
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

    def _unref_swa(self, pages):
        """Pages leaving requests' windows: the cache-held ones (in a window, exactly those with
        references) lose one; orphans that nobody reads are freed. Returns the mask of `pages`
        that are cache-held, or None when none is. (On a decode step's few pages, argmax and
        astype cost a fraction of any() and a comparison: this runs every step.)"""
        if not self._windowed_cached or not len(pages):
            return None
        refs = self.swa_refs
        r = refs[pages]
        if not r[r.argmax()]:
            return None
        held = r.astype(bool)
        p = pages[held]
        self._windowed_cached -= len(p)
        np.subtract.at(refs, p, 1)   # two requests resumed from one point may retire a page together
        left = refs[p]
        if not left[left.argmin()]:   # mostly not: a tail still pinned by its capture keeps a reference
            # once each: a page two windows retire together is listed twice in p
            zero = np.unique(p[left == 0])
            orphans = zero[self.swa_orphan[zero]]
            self._drop_cached_swa(orphans)
            if self.ledger is not None:
                self.ledger.add_evictable(SWA_PAGES, len(zero) - len(orphans))
        return held

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
            self._windowed_cached += len(swa)
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

    def share_written(self, slot: int, col: int, cached_page: int = 0) -> int:
        """A running request's full page at table column `col`, complete and committed (written
        in a pass that is over, so no rollback reaches it), becomes the cache's while its writer
        keeps reading it: the page joins the slot's leading shared pages (`full_shared`), read-only
        from now on, its writer one of its readers. `cached_page` (the same content cached
        meanwhile by another request): the slot reads that page instead and its own is freed.
        Columns go in order from the first not shared. Returns the page the slot now reads."""
        # (complete and committed: its end at most the committed length, committed_lengths;
        # share_written_runs checks the same of many pages at once)
        if self.full is None or col != self.full_shared[slot] or col >= self.full_held[slot] \
                or (col + 1) * self.P > self.committed_lengths(slot):
            raise KvatlasError(f"share: column {col} of slot {slot} is not its next complete, committed page")
        own = int(self.full_table[slot, col])
        if self.full.owner[own] != slot + 1:
            raise KvatlasError("share: a shared page is not the writer's own")
        if cached_page:
            if self.full.owner[cached_page] != CACHE_OWNER:
                raise KvatlasError("share: the cached page given is not the cache's")
            self._free(self.full, FULL_PAGES, np.array([own], np.int64))
            if self.ledger is not None:
                self.ledger.add_units(FULL_PAGES, -1)
                for r in self.ratios:
                    self.ledger.add_entries(ratio_key(r), -(self.P // r))
                if self.full_refs[cached_page] == 0:
                    self.ledger.add_evictable(FULL_PAGES, -1)
            self.full_table[slot, col] = own = cached_page
        else:
            self.full.owner[own] = CACHE_OWNER   # (its entries move from the request's count to the cache's)
        self.full_refs[own] += 1
        self.full_shared[slot] = col + 1
        return own

    def share_written_runs(self, slots: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """share_written of each slot's pages at columns starts .. ends - 1, none of them cached
        already (their keys new to the cache), all in one go (slots distinct); returns the pages,
        slot after slot."""
        if self.full is None or np.any(starts != self.full_shared[slots]) or np.any(ends > self.full_held[slots]) \
                or np.any(ends * self.P > self.committed_lengths(slots)) or np.any(ends <= starts):
            raise KvatlasError("share: columns given are not the slots' next complete, committed pages")
        rows, cols = spread(slots, ends - starts, starts)
        pages = self.full_table[rows, cols]
        if np.any(self.full.owner[pages] != rows + 1):
            raise KvatlasError("share: a shared page is not the writer's own")
        self.full.owner[pages] = CACHE_OWNER
        self.full_refs[pages] += 1
        self.full_shared[slots] = ends
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
            self._back(lambda: ((FULL_PAGES, self.full.peek(n)),))
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
            self._back(lambda: ((CHECKPOINTS, self.ckpt.peek(1)),) + (((SWA_PAGES, self.swa.peek(tail)),) if tail else ()))
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
            out["swa"] = L - (int(self.swa_lo[slot]) + self.swa_cached_pages(slot)) * self.Ps
        return out

    def window_swa_pages(self, slot: int) -> np.ndarray:
        """The SWA pages the slot's window holds (logical pages [swa_lo, swa_hi))."""
        return self.swa_table[slot, np.arange(self.swa_lo[slot], self.swa_hi[slot]) % self.ring]

    def swa_cached_pages(self, slot: int) -> int:
        """Cache-held pages among the SWA pages the slot's window holds."""
        return int(np.count_nonzero(self.swa.owner[self.window_swa_pages(slot)] == CACHE_OWNER))

    def cached_swa_check(self, live) -> list[str]:
        """Integrity of the sharing arrays (called by alloc.integrity)."""
        out = []
        if self.full is not None:
            want = np.zeros_like(self.full_refs)
            for s in live:
                np.add.at(want, self.full_table[s, : self.full_shared[s]], 1)
            if not np.array_equal(want[1:], self.full_refs[1:]):
                out.append("full_pages: reference counts disagree with the requests' tables")
        if self.swa is not None:   # a cache-held page in windows has a reference for each of them
            readers = np.zeros_like(self.swa_refs)
            for s in live:
                held = self.window_swa_pages(s)
                np.add.at(readers, held[self.swa.owner[held] == CACHE_OWNER], 1)
            if np.any(readers[1:] > self.swa_refs[1:]):
                out.append("swa_pages: a cache-held page has fewer references than windows reading it")
            if int(readers.sum()) != self._windowed_cached:
                out.append(f"swa_pages: {int(readers.sum())} cache-held pages in windows, "
                           f"{self._windowed_cached} counted")
        if self.ckpt is not None:
            out += self.ckpt.check("checkpoints")
            free = np.ones(len(self.pend_b), bool)
            free[list(live)] = False
            if (self.pend_b[free].any() or self.pend_u[free].any() or np.any(self.row_base[free] != NO_ROW)
                    or not self.older.keys() <= set(live)):
                out.append("checkpoints: a free request slot has a pending resume point")
        return out


class _Schedule:
    """When each token of a steady batch (see Sharing._steady_rows) writes a tail position, and
    its row: at step t after the one it was made at, token j is at pos_j + t, in the tail of the
    next boundary while t - k < e_j <= t (e_j = page_tokens - k - within_j), and its row is
    row_base + pos_j + t. Tokens sorted by e_j, each step's hits are one contiguous run. It holds
    for page_tokens - k steps (within them a token meets one tail at most); every change of
    row_base meanwhile (an upkeep's units, a unit taken or given back between upkeeps) patches
    the rows of the slots it changes (`patch`), so a batch short of units keeps its schedule."""

    __slots__ = ("batch", "epoch", "writes", "t", "horizon", "order", "slots", "pos", "rows", "where",
                 "lo", "hi")

    @classmethod
    def make(cls, alloc, batch, tok_slots, pos, within, epoch: int, writes: int):
        P, k = alloc.P, alloc.resume_tokens
        e = (P - k) - within
        order = np.argsort(e.astype(np.int16) if P < 1 << 15 else e, kind="stable")   # (16-bit: a radix sort)
        e = e.take(order)
        sched = cls()
        sched.slots = tok_slots.take(order)
        sched.pos = pos.take(order)
        sched.rows = alloc.row_base.take(sched.slots)
        sched.rows += sched.pos
        sched.where = np.full(len(alloc.row_base), -1, np.int64)   # slot -> its token's place in order
        sched.where[sched.slots] = np.arange(len(order))
        sched.batch, sched.epoch, sched.writes, sched.t, sched.horizon = batch, epoch, writes, 0, P - k
        steps = np.arange(P - k, dtype=np.int64)
        sched.order = order
        sched.lo = np.searchsorted(e, steps - k, side="right").tolist()
        sched.hi = np.searchsorted(e, steps, side="right").tolist()
        return sched

    def patch(self, slots, row_base) -> None:
        """row_base changed at `slots` (one slot or an array): their tokens' rows follow."""
        if np.ndim(slots) == 0:
            slot = int(slots)
            i = int(self.where[slot])
            if i >= 0:
                self.rows[i] = int(row_base[slot]) + int(self.pos[i])
            return
        i = self.where[slots]
        if not len(i):
            return
        if i[i.argmin()] < 0:   # (slots not in the batch)
            keep = i >= 0
            i, slots = i[keep], np.asarray(slots)[keep]
        self.rows[i] = row_base.take(slots) + self.pos.take(i)
