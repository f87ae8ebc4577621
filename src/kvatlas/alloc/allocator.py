"""The allocator: request slots, full-token pages, SWA pages and state rows for every request.

Full-token pages (page_tokens each) carry every compressed pool at once: the entry for position
p of ratio r lives in page table[p // page_tokens], entry (p % page_tokens) // r. Admission
reserves the pages a request's declared length needs, so a running request never runs out of
full pages before its declared end; can_admit() answers from the same counters. SWA pages
(swa_page_tokens each) follow the window: a page that falls wholly below the keys the next
query needs is retired when the next forward pass begins. Each step() or extend() is one forward
pass, unless several are grouped under `with allocator.forward():` (a mixed prefill/decode
batch); the indices a call returns stay valid until the next forward begins (or flush()).

Every check happens before any mutation: a refused call leaves every array as it was.
Rollback, trimming and finish (taking pages back) live in release.py.

Lazily backed arenas (the `vmm` backend) pass `backing` (Backend.allocator_hooks()): ids then
come lowest-first (LowestFreeList), so live data stays dense and chunks empty out; before units
are handed out the backing maps the chunks they lie in, or refuses (cap on physical bytes, or the
device out of memory) before anything here changes; units given back are reported to it. With
backing=None (the plain backend) none of this runs: the LIFO free lists and the same code path.
"""

from __future__ import annotations

import contextlib

import numpy as np

from ..planning.buffers import CHECKPOINTS, FULL_PAGES, REQUEST_SLOTS, SWA_PAGES
from ..checks import request_id as check_request_id, whole
from ..errors import ConfigError, KvatlasError, PoolExhaustedError, RequestStateError
from ..planning.model import LayerKind
from ..units import cdiv
from .arrays import EMPTY, div, mod, ramp, spread
from .entries import ratio_key
from .freelist import FreeList
from .indices import Admission, RequestBatch, WriteIndices
from .lowest import LowestFreeList
from .release import Release
from .sharing import Sharing


# a one-token step of one request takes Allocator._write_one's scalar path (tests turn it off to
# compare it with the general one)
ONE_STEP = True


def one(v: int) -> np.ndarray:
    """[v] as int64."""
    return np.array((v,), np.int64)


def id_list(request_ids) -> tuple:
    """A batch's ids as a tuple; one string (or bytes) is refused, not split into characters."""
    if isinstance(request_ids, (str, bytes)) or not hasattr(request_ids, "__iter__"):
        raise ConfigError("request_ids", f"{_short(request_ids)} is not a list of request ids",
                          "give a list (or tuple) of running ids, or a cache.batch(...)")
    return tuple(request_ids)


def _short(value) -> str:
    r = repr(value)
    return r if len(r) <= 60 else r[:50] + "…"


class Allocator(Release, Sharing):
    def __init__(self, plan, ledger=None, backing=None) -> None:
        self.plan, self.ledger, self.backing = plan, ledger, backing
        free_list = FreeList if backing is None else LowestFreeList
        o = plan.options
        self.P, self.window = o.page_tokens, plan.model.sliding_window
        self.max_len = o.max_model_len
        self.window_rows = plan.sizing.window_rows            # V4.1: per-slot window ring
        self.Ps = o.swa_page_tokens
        n = plan.num_request_slots
        self.slots = free_list(n)
        self.full = free_list(plan.num_full_pages) if plan.has_compressed else None
        self.swa = free_list(plan.num_swa_pages) if not self.window_rows else None
        self.ring = plan.sizing.swa_ring_pages
        self.length = np.zeros(n, np.int64)
        self.full_held = np.zeros(n, np.int64)
        self.reserved = np.zeros(n, np.int64)
        self.swa_lo = np.zeros(n, np.int64)   # SWA logical pages [lo, hi) are held
        self.swa_hi = np.zeros(n, np.int64)
        self.last_write = np.zeros(n, np.int64)
        self.full_table = np.zeros((n, plan.sizing.pages_per_request), np.int64)
        self.swa_table = np.zeros((n, max(self.ring, 1)), np.int64)
        self.outstanding = 0                  # reserved full pages not yet held
        self.slot_of: dict = {}
        self.rid_of: list = [None] * n
        self.ratios = sorted({LayerKind(b.layer_kind).ratio for b in plan.buffers
                              if b.group == FULL_PAGES and b.role == "kv"})
        self.rings = {b.name: b.entries_per_unit for b in plan.buffers if b.role == "state"}
        self._written: list[np.ndarray] = []   # slots written in the current forward pass
        self._written_epoch = 0                 # the epoch of the last write
        self._epoch = 0                         # bumped by admit/finish: RequestBatch staleness
        self._memo = None                       # (epoch, ids, slots) of the last id list resolved
        self._grouped = 0
        self._group_start = np.zeros(n, np.int64)   # lengths as the current forward() group began
        self._in_group_pass = False                 # the pass in progress is a forward() group's
        self._init_sharing(plan, free_list)

    @property
    def epoch(self) -> int:
        """Bumped by every admission and finish: what was resolved for a set of slots in an earlier
        epoch may name another request's slot now."""
        return self._epoch

    # ---------------------------------------------------------------- admission
    def _validate_lengths(self, prompt_tokens, max_new_tokens) -> int:
        total = whole("prompt_tokens", prompt_tokens, 1) + whole("max_new_tokens", max_new_tokens, 0)
        if total > self.max_len:
            raise KvatlasError(f"prompt_tokens + max_new_tokens = {total} exceeds max_model_len {self.max_len}; "
                               "shorten the request or plan a larger max_model_len")
        return total

    def _admission_shortfall(self, total_tokens: int, shared_pages: int = 0):
        if self.slots.free == 0:
            return PoolExhaustedError("request_slots", 1, 0, "slots", "admission")
        if self.full is not None:
            pages = cdiv(total_tokens, self.P) - shared_pages
            free = self.full.free - self.outstanding
            if pages > free:
                return PoolExhaustedError("full_pages", pages, free, "pages", "admission")
        return self._slot_rows_shortfall()

    def _slot_rows_shortfall(self):
        """The backing's refusal to map the next slot's state rows (they are cleared at
        admission), else None (also without a lazy backing)."""
        if self.backing is None:
            return None
        return self.backing.shortfall(((REQUEST_SLOTS, self.slots.peek(1)),))

    def can_admit(self, prompt_tokens: int, max_new_tokens: int = 0) -> bool:
        return self._admission_shortfall(self._validate_lengths(prompt_tokens, max_new_tokens)) is None

    def admit(self, request_id, prompt_tokens: int, max_new_tokens: int = 0, shared=None) -> Admission:
        """shared (prefix cache): a SharedPrefix to start from, its pages read-only."""
        check_request_id(request_id)
        total = self._validate_lengths(prompt_tokens, max_new_tokens)
        if request_id in self.slot_of:
            raise RequestStateError(f"request_id {request_id!r} is already running; finish it first or use a new id")
        if shared is not None:
            self.check_shared(shared, total)
        k = shared.boundary_tokens // self.P if shared is not None and self.full is not None else 0
        short = self._admission_shortfall(total, k)
        if short is not None:
            if self.ledger is not None:
                self.ledger.admission_refusals += 1
            raise short
        if self.backing is not None:
            self._back(((REQUEST_SLOTS, self.slots.peek(1)),), admission=True)
        slot = int(self.slots.pop(1, 0)[0])
        self.slots.owner[slot] = slot + 1
        pages = cdiv(total, self.P) if self.full is not None else 0
        self.reserved[slot] = pages
        self.outstanding += pages - k
        if shared is not None:
            self._attach(slot, shared)
        self.slot_of[request_id] = slot
        self.rid_of[slot] = request_id
        self._epoch += 1
        if self.ledger is not None:
            self.ledger.add_units(REQUEST_SLOTS, 1)
            self.ledger.running_requests += 1
        rows = {name: np.arange(slot * ring, (slot + 1) * ring) for name, ring in self.rings.items()}
        return Admission(request_id=request_id, request_slot=slot, reserved_pages=pages, state_rows=rows,
                         cached_tokens=shared.boundary_tokens if shared is not None else 0,
                         resume_unit=shared.checkpoint_unit if shared is not None else 0)

    # ---------------------------------------------------------------- writes
    def batch(self, request_ids) -> RequestBatch:
        """Resolve a running batch once; pass it to step() instead of the id list."""
        ids = id_list(request_ids)
        return RequestBatch(ids, self._slots(ids), self._epoch)

    def _slots(self, request_ids) -> np.ndarray:
        if isinstance(request_ids, RequestBatch):
            if request_ids.epoch != self._epoch:
                request_ids.slots = self._slots(request_ids.request_ids)
                request_ids.epoch = self._epoch
            return request_ids.slots
        key = request_ids if isinstance(request_ids, tuple) else id_list(request_ids)
        memo = self._memo   # engines step the same batch again and again: compare, don't look up
        if memo is not None and memo[0] == self._epoch and memo[1] == key:
            return memo[2]
        try:
            slots = np.fromiter(map(self.slot_of.__getitem__, key), np.int64, len(key))
        except KeyError as exc:
            raise RequestStateError(f"request_id {exc.args[0]!r} is not running (never admitted or finished); "
                                    "admit it first") from None
        except TypeError:   # an unhashable id: never admitted, so never running
            check = [check_request_id(r) for r in key]   # raises naming the id
            raise RequestStateError(f"request_ids {check!r} cannot be looked up; give running ids") from None
        if len(slots) > 1 and np.bincount(slots, minlength=1).max() > 1:
            raise RequestStateError("request_ids: a request appears twice in one step; list each once")
        self._memo = (self._epoch, key, slots)   # never handed out: _indices copies
        return slots

    def extend(self, request_id, num_tokens: int) -> WriteIndices:
        """Chunked prefill: write the next num_tokens of one request."""
        num_tokens = whole("num_tokens", num_tokens, 1)
        if num_tokens > self.plan.options.chunked_prefill_tokens:
            raise KvatlasError(f"num_tokens: {num_tokens} exceeds chunked_prefill_tokens="
                               f"{self.plan.options.chunked_prefill_tokens}; split the prompt into chunks")
        slots = self._slots([request_id])
        counts = np.array([num_tokens], np.int64)
        L0 = self.length[slots]
        self._check_length(L0 + counts)
        self._begin_forward()
        return self._write(slots, counts, L0, prefill=True)

    def step(self, request_ids, tokens_each=1) -> WriteIndices:
        """One forward pass for a batch: every request writes tokens_each (1 + drafts) tokens."""
        slots = self._slots(request_ids)
        if isinstance(tokens_each, (int, np.integer)) and not isinstance(tokens_each, bool):
            counts = int(tokens_each)   # uniform batch: scalar arithmetic, no per-request arrays
            low = counts
        else:
            counts = np.asarray(tokens_each)
            if counts.dtype.kind not in "iu" or counts.ndim != 1:   # 1.5 or "2" must not become 1 or fail in numpy
                raise ConfigError("tokens_each", f"{_short(tokens_each)} is not whole numbers",
                                  "give one integer, or one per request")
            counts = counts.astype(np.int64)
            if counts.shape != slots.shape:
                raise KvatlasError(f"tokens_each: {counts.shape[0] if counts.ndim else 'a non-integer'} counts "
                                   f"for {len(slots)} requests; give one integer, or one per request")
            low = int(counts.min(initial=1))
        if low < 1:
            raise KvatlasError("tokens_each: every request must write at least 1 token")
        most = 1 + self.plan.options.draft_tokens
        if (counts if isinstance(counts, int) else int(counts.max(initial=1))) > most:
            raise KvatlasError(f"tokens_each: a decode step writes at most 1 + draft_tokens = {most} tokens "
                               "(the state rings are sized for that); plan with more draft_tokens or use extend()")
        if ONE_STEP and isinstance(counts, int) and counts == 1 and len(slots) == 1:
            L0 = int(self.length[slots[0]])
            if L0 + 1 > self.max_len:
                self._check_length(np.array([L0 + 1]))
            self._begin_forward()
            w = self._write_one(slots, int(slots[0]), L0)
            if w is not None:
                return w
            return self._write(slots, 1, self.length[slots], prefill=False)
        L0 = self.length[slots]   # retiring SWA pages below never changes lengths
        self._check_length(L0 + counts)
        self._begin_forward()   # only after the call is known valid: retiring is a state change
        return self._write(slots, counts, L0, prefill=False)

    @contextlib.contextmanager
    def forward(self):
        """Group several extend()/step() calls into one forward pass: no page they were handed
        is retired until the group ends and a later forward begins."""
        self._begin_forward()
        if not self._grouped:   # (what committed_lengths gives until the pass is over)
            np.copyto(self._group_start, self.length)
            self._in_group_pass = True
        self._grouped += 1
        try:
            yield self
        finally:
            self._grouped -= 1

    def flush(self) -> None:
        """The last forward pass has completed: retire what fell out of every window now, and
        make the resume-point captures still waiting for their batch (prefix cache)."""
        if not self._grouped:
            self._begin_forward(settle=True)

    def committed_lengths(self, slots=None):
        """Each slot's length when the last forward pass was over: what the pass in progress has
        written left out (its last write; for a `forward()` group, which may write a request more
        than once, the lengths as the group began, until the next pass begins or a flush).
        `slots`: one slot (an int back) or an array of them; all if None. The prefix cache shares
        and keys the pages complete at these lengths (its _sync, generated), and share_written
        shares no other."""
        if slots is None:
            return self._group_start.copy() if self._in_group_pass else self.length - self.last_write
        got = self._group_start[slots] if self._in_group_pass else self.length[slots] - self.last_write[slots]
        return int(got) if np.ndim(got) == 0 else got

    def commit_pass(self) -> None:
        """Within _begin_forward: the pass just over is committed (no rollback reaches it), so
        its requests' lengths count as written whole (share_written's check) before the rest of
        _begin_forward clears it. Called only there, by the prefix cache sharing pages then."""
        if self._written:
            self.last_write[np.concatenate(self._written)] = 0

    def _begin_forward(self, settle: bool = False) -> None:
        if self._grouped:
            return
        self._in_group_pass = False
        if self.prefix_on:   # the pass is over: the resume points it reached are final
            self._passes += 1
            if self.on_pass_over is not None:   # (also with nothing written: pages keyed since, by generated)
                self.on_pass_over()   # the prefix cache notes the pages now complete (commit_pass to share them now)
            self._defer_tokens += self._pass_tokens
            self._pass_tokens = 0
            if settle or self._defer_tokens >= self._defer_limit:
                self.commit_pass()   # (a capture the cache keeps may share pages: see commit_pass)
                self._upkeep()   # before retiring: a due capture's tail is still in its window
        if not self._written:
            return
        written = np.unique(np.concatenate(self._written)) if len(self._written) > 1 else self._written[0]
        self._written.clear()
        # the last forward is over: its tokens are committed (a rollback belongs to the pass that
        # wrote the drafts), so pages below the window of the committed length can go
        self.last_write[written] = 0
        if self._epoch != self._written_epoch:   # some request finished since: skip its slot
            written = written[self.slots.owner[written] != 0]
        self._retire(written)

    def _retire(self, slots: np.ndarray) -> None:
        if self.swa is None or len(slots) == 0:
            return
        if len(slots) == 1 and ONE_STEP:   # one request's step (scalars): most retire nothing
            s = int(slots[0])
            if (int(self.length[s]) - (self.window - 1)) // self.Ps <= int(self.swa_lo[s]):
                return
        k = div(self.length[slots] - (self.window - 1), self.Ps) - self.swa_lo[slots]
        i = np.flatnonzero(k > 0)
        if len(i) == 0:
            return
        slots, k = slots[i], k[i]
        total = int(k.sum())
        rows, logical = spread(slots, k, self.swa_lo[slots])
        cols = mod(logical, self.ring)
        pages = self.swa_table[rows, cols].copy()
        if self._windowed_cached:   # pages the cache holds lose a reader, they are not freed
            cached = self._unref_swa(pages)
            if cached is not None:
                pages = pages[~cached]
                total = len(pages)
        self._free(self.swa, SWA_PAGES, pages, defer=True)
        self.swa_table[rows, cols] = 0
        self.swa_lo[slots] += k
        if self.ledger is not None:
            self.ledger.add_units(SWA_PAGES, -total)
            self.ledger.add_entries("swa", -total * self.Ps)

    def _check_length(self, L1) -> None:
        if int(L1.max(initial=0)) > self.max_len:
            raise KvatlasError(f"a request would reach {int(L1.max())} tokens, beyond max_model_len {self.max_len}; "
                               "finish it or plan a larger max_model_len")

    def _check_write(self, slots, L1):
        """Which requests need new pages, and how many; raises before anything changes.
        Works on the few requests that cross a page boundary, not on the whole batch."""
        full = self._need_full(slots, L1) if self.full is not None else (EMPTY, EMPTY)
        swa = self._need_swa(slots, L1) if self.swa is not None else (EMPTY, EMPTY)
        return full, swa

    def _need_full(self, slots, L1):
        need = div(L1 + (self.P - 1), self.P) - self.full_held[slots]
        i = np.flatnonzero(need)
        if len(i) == 0:          # most decode steps cross few page boundaries
            return EMPTY, EMPTY
        sub, n = slots[i], need[i]
        over = np.maximum(self.full_held[sub] + n - self.reserved[sub], 0) \
            - np.maximum(self.full_held[sub] - self.reserved[sub], 0)
        free = self.full.free - self.outstanding
        if int(over.sum()) > free:
            raise PoolExhaustedError("full_pages", int(over.sum()), free, "pages",
                                     "write beyond the requests' reserved length")
        return sub, n

    def _need_swa(self, slots, L1):
        hi = div(L1 + (self.Ps - 1), self.Ps)
        need = hi - self.swa_hi[slots]
        i = np.flatnonzero(need)
        if len(i) == 0:
            return EMPTY, EMPTY
        sub, n = slots[i], need[i]
        if int((hi[i] - self.swa_lo[sub]).max()) > self.ring:
            raise KvatlasError(f"one write spans more SWA pages than a request can hold ({self.ring}); keep "
                               f"chunks within chunked_prefill_tokens={self.plan.options.chunked_prefill_tokens}")
        if int(n.sum()) > self.swa.free and self.prefix_on:
            self._commit_captures(passed_only=True)   # waiting captures hold tails their decisions give back
        if int(n.sum()) > self.swa.free and self.on_need_checkpoint is not None:
            # resume points hold SWA tails: drop some rather than refuse a write
            while int(n.sum()) > self.swa.free and self.on_need_checkpoint():
                pass
        if int(n.sum()) > self.swa.free:
            raise PoolExhaustedError("swa_kv", int(n.sum()), self.swa.free, "pages",
                                     "prefill in flight beyond the planned chunk budget")
        return sub, n

    def _back(self, requests, admission: bool = False) -> None:
        """Have the backing map the chunks of the units about to be handed out; it refuses
        (PoolExhaustedError "physical") before anything changes. requests: (group, ids) pairs, or
        a callable making them from the free lists' peeks. When the backing is out of physical
        memory and a prefix cache holds units, the cache evicts some (`on_need_physical`, more each
        try) and the units are asked for again: pages it gives back free ids in mapped chunks,
        which lowest-first placement hands out next, and chunks they empty are given up for room.
        The cache first checks that evicting can make room (the backing's `refused` units, its
        `fits_after`): if not, it evicts nothing and the refusal stands."""
        tries = 0
        while True:
            try:
                self.backing.acquire(requests() if callable(requests) else requests)
                return
            except PoolExhaustedError as exc:
                if exc.pool == "physical" and self.on_need_physical is not None and self.on_need_physical(tries, exc):
                    tries += 1
                    continue
                if admission and self.ledger is not None:
                    self.ledger.admission_refusals += 1
                raise

    def lowest_free(self, group: str, n: int) -> np.ndarray:
        """The n lowest free ids of an index space handed out lowest-first (a lazily backed
        arena's): the ids its next units get."""
        return {FULL_PAGES: self.full, SWA_PAGES: self.swa, CHECKPOINTS: self.ckpt,
                REQUEST_SLOTS: self.slots}[group].peek(n)

    def _page_requests(self, full, swa) -> list:
        """The page ids the coming _take_full/_take_swa will pop, by index space."""
        out = []
        for group, fl, need in ((FULL_PAGES, self.full, full[1]), (SWA_PAGES, self.swa, swa[1])):
            if fl is not None and len(need):
                out.append((group, fl.peek(int(need.sum()))))
        return out

    def _free(self, freelist, group: str, ids: np.ndarray, defer: bool = False) -> None:
        """defer: pages retired from the window, the decode path; the backing may count them
        dead lazily (their chunks stay mapped a little longer, never less)."""
        freelist.push(ids)
        if self.backing is not None:
            self.backing.release(group, ids, defer=defer)

    def _take_full(self, sub, need) -> None:
        total = int(need.sum())
        if total == 0:
            return
        before = np.maximum(self.reserved[sub] - self.full_held[sub], 0)
        rows, cols = spread(sub, need, self.full_held[sub])
        self.full_table[rows, cols] = self.full.pop(total, rows)
        self.full_held[sub] += need
        self.outstanding -= int((before - np.maximum(self.reserved[sub] - self.full_held[sub], 0)).sum())
        if self.ledger is not None:
            self.ledger.add_units(FULL_PAGES, total)

    def _take_swa(self, sub, need) -> None:
        total = int(need.sum())
        if total == 0:
            return
        rows, logical = spread(sub, need, self.swa_hi[sub])
        self.swa_table[rows, mod(logical, self.ring)] = self.swa.pop(total, rows)
        self.swa_hi[sub] += need
        if self.ledger is not None:
            self.ledger.add_units(SWA_PAGES, total)

    def _write(self, slots, counts, L0, prefill: bool) -> WriteIndices:
        L1 = L0 + counts
        full, swa = self._check_write(slots, L1)
        if self.backing is not None:
            self._back(lambda: self._page_requests(full, swa))
        if self.full is not None:
            self._take_full(*full)
        if self.swa is not None:
            self._take_swa(*swa)
        progress = self._wrote(slots, counts, L1)
        return self._counted(self._indices(slots, counts, L0, prefill, progress))

    def _wrote(self, slots, counts, L1) -> int:
        """What every write changes (lengths, the pass's written slots); returns the prefix
        cache's progress: the most tokens a request has written since the last upkeep."""
        self.length[slots] = L1
        self.last_write[slots] = counts
        self._written.append(slots)
        self._written_epoch = self._epoch
        self._writes += 1
        if not self.resume_tokens:
            return 0
        most = counts if isinstance(counts, int) else int(counts.max())
        if self._grouped:   # the pass may write a request more than once
            self._pass_tokens += most
        elif most > self._pass_tokens:
            self._pass_tokens = most
        return self._defer_tokens + self._pass_tokens

    def _counted(self, idx: WriteIndices) -> WriteIndices:
        if self.ledger is not None:  # the block-completion masks already count new compressed entries
            if self.swa is not None:
                self.ledger.add_entries("swa", idx.num_tokens)
            for r, (mask, _) in idx.compressed.items():
                self.ledger.add_entries(ratio_key(r), int(np.count_nonzero(mask)))
        return idx

    def _write_one(self, slots, s: int, L0: int) -> WriteIndices | None:
        """_write of one decode token of one request (slot s, at L0) that needs no new page: the
        same changes and the same indices, made from scalars (a lone request's decode step is
        what a model waits on, and the arrays' per-call costs are most of it). None when a page
        is due: then _write does the step."""
        L1 = L0 + 1
        if self.full is not None and -(-L1 // self.P) != self.full_held[s]:
            return None
        if self.swa is not None and -(-L1 // self.Ps) != self.swa_hi[s]:
            return None
        if self.backing is not None:
            self._back([])
        progress = self._wrote(slots, 1, L1)
        P = self.P
        compressed = {}
        if self.full is not None:
            f = int(self.full_table[s, L0 // P]) * P + L0 % P
            full_slots = one(f)
            for r in self.ratios:
                compressed[r] = (np.array(((L0 + 1) % r == 0,)), one(f // r))
        else:
            full_slots = one(-1)
        if self.swa is not None:
            swa = int(self.swa_table[s, L0 // self.Ps % self.ring]) * self.Ps + L0 % self.Ps
        else:
            swa = s * self.window_rows + L0 % self.window_rows
        by_ring = {ring: one(s * ring + L0 % ring) for ring in set(self.rings.values())}
        tok_slots, pos = one(s), one(L0)
        rows = {name: by_ring[ring] for name, ring in self.rings.items()}
        ckpt = self._checkpoint_rows(tok_slots, pos, one(L0 % P), progress, slots) if progress else {}
        return self._counted(WriteIndices(request_slots=tok_slots, positions=pos, swa_slots=one(swa),
                                          full_slots=full_slots, compressed=compressed, state_rows=rows,
                                          workspace_rows=EMPTY, checkpoint_rows=ckpt))

    def _count_entries(self, L0, L1, written: int, sign: int = 1) -> None:
        if self.ledger is None:
            return
        if self.swa is not None:
            self.ledger.add_entries("swa", sign * written)
        for r in self.ratios:
            self.ledger.add_entries(ratio_key(r), sign * int((div(L1, r) - div(L0, r)).sum()))

    def _indices(self, slots, counts, L0, prefill: bool, progress: int = 0) -> WriteIndices:
        """progress > 0 (prefix cache): also the resume rows to save (_checkpoint_rows)."""
        one = None   # a one-token decode step: its batch's slots array (prefix cache)
        if isinstance(counts, int):
            if counts == 1:   # a copy: `slots` may be the memo's or a RequestBatch's array
                tok_slots, pos = slots.copy(), L0
                one = None if prefill else slots
            else:
                offsets = np.tile(np.arange(counts, dtype=np.int64), len(slots))
                tok_slots, pos = np.repeat(slots, counts), np.repeat(L0, counts) + offsets
        else:
            tok_slots, pos = np.repeat(slots, counts), np.repeat(L0, counts) + ramp(counts)
        compressed = {}
        within = mod(pos, self.P)   # position within its full page
        if self.full is not None:   # 1-D takes from the flat tables: cheaper than 2-D fancy indexing
            cols = self.full_table.shape[1]
            page = self.full_table.ravel().take(tok_slots * cols + div(pos, self.P))
            full_slots = page * self.P + within
            pos1 = pos + 1
            for r in self.ratios:  # r divides P, so entry = page * (P // r) + within // r = full_slot // r
                compressed[r] = (mod(pos1, r) == 0, div(full_slots, r))
        if self.swa is not None:
            page = self.swa_table.ravel().take(tok_slots * self.ring + mod(div(pos, self.Ps), self.ring))
            swa = page * self.Ps + mod(pos, self.Ps)
        else:
            swa = tok_slots * self.window_rows + mod(pos, self.window_rows)
        by_ring: dict[int, np.ndarray] = {}   # pools with equal rings share one array
        for ring in set(self.rings.values()):
            by_ring[ring] = tok_slots * ring + mod(pos, ring)
        rows = {name: by_ring[ring] for name, ring in self.rings.items()}
        if self.full is None:
            full_slots = np.full(len(pos), -1, np.int64)
        ws = np.arange(len(pos), dtype=np.int64) if prefill and self.window_rows else EMPTY
        return WriteIndices(request_slots=tok_slots, positions=pos, swa_slots=swa, full_slots=full_slots,
                            compressed=compressed, state_rows=rows, workspace_rows=ws,
                            checkpoint_rows=self._checkpoint_rows(tok_slots, pos, within, progress, one)
                            if progress else {})
