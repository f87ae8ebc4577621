"""PrefixCache: match a prompt's pages at admission, keep resume points, publish pages at finish.

A request's life with the cache (see the README): admit(token_ids=...) walks the tree along the
prompt's page keys; the hit is the deepest matched page boundary that has a resume point and
leaves at least one prompt token to compute. The request starts there (`Admission.cached_tokens`),
reading the cached pages read-only. Every boundary it reaches is captured; the policy keeps some
(kvatlas.prefix.policy). At finish its full pages and kept resume points join the tree; pages
already there (the same content, cached meanwhile) are freed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..alloc.arrays import spread
from ..checks import boolean, request_id as check_request_id, whole
from ..errors import KvatlasError, PoolExhaustedError, RequestStateError
from ..planning.buffers import CHECKPOINTS, FULL_PAGES, SWA_PAGES
from ..units import cdiv
from .keys import (ContentMismatchError, PromptKeys, as_tokens, check_keys, page_keys, prompt_keys, prompt_tail,
                   verified_keys)
from .policy import fitted, policy_named, refitted
from .record import Recorder
from .stats import PrefixStats
from .tree import REUSE_WEIGHT, Checkpoint, Tree, checked_reuse_weight


REFIT_FINISHES = 64
NEVER = np.iinfo(np.int64).max   # _fill_due of a slot with no page to share


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """What a request resumes from: the boundary, the cached full pages before it, the SWA pages
    of its tail, and the checkpoint unit whose rows are copied into the request's rings."""
    boundary_tokens: int
    full_pages: np.ndarray
    swa_pages: np.ndarray
    checkpoint_unit: int


class _Request:
    __slots__ = ("keys", "path", "kept", "prompt_tokens", "tail", "ids", "same_tokens", "stale_tokens")

    def __init__(self, keys, path, prompt_tokens, tail=None) -> None:
        # path: the tree's nodes of the request's leading pages that it reads (its hit, then the
        # pages it shared as it wrote them), each holding one reference of it
        self.keys, self.path, self.prompt_tokens = keys, path, prompt_tokens
        self.tail = tail   # the prompt's ids past its last full page (None: admitted without ids)
        self.kept: list = []
        self.ids = None    # the ids `generated` checked, of the pages keyed past the prompt
        # after copy_contents: resume points at boundaries in (same_tokens, stale_tokens] hold rows
        # of the content the request had before (see PrefixCache.copy_contents)
        self.same_tokens = self.stale_tokens = 0

    def holds_other(self, boundary_tokens: int) -> bool:
        """Whether a resume point this request saved at that boundary holds other content."""
        return self.same_tokens < boundary_tokens <= self.stale_tokens


@dataclass(frozen=True, slots=True)
class _Match:
    keys: np.ndarray
    path: list
    resume_pages: int
    writer: int | None = None   # the slot whose latest resume point the match resumes at


class PrefixCache:
    def __init__(self, allocator, ledger=None, policy="kvatlas", share_as_written: bool = True,
                 reuse_weight: float = REUSE_WEIGHT, keep_prompt_ends: bool = True) -> None:
        if not allocator.prefix_on:
            raise KvatlasError("prefix_checkpoints: the plan has no prefix cache; plan with prefix_checkpoints > 0")
        reuse_weight = checked_reuse_weight(reuse_weight)
        self.alloc, self.ledger = allocator, ledger
        self.P = allocator.P
        self.policy = fitted(policy_named(policy), max(allocator.plan.num_full_pages - 1, 0),
                             allocator.plan.options.prefix_checkpoints, self.P)
        self._finishes = 0   # a refitting policy is fitted again every REFIT_FINISHES finishes
        self.stats = PrefixStats()
        self._tree = Tree(allocator, self.policy, self.stats, ledger, reuse_weight=reuse_weight)
        self.requests: dict = {}
        self._intermediate: deque = deque()   # (request, kept intermediate point): what goes first
        self.clock = 0
        # per request slot: the request's latest captured resume point (tentative: kept or dropped
        # when its next one is captured, its end point if it finishes first), whether the slot's
        # request is this cache's, and the boundary where its prompt left the tree (-1: none)
        n, tail = allocator.plan.num_request_slots, allocator.tail_swa_pages if allocator.swa is not None else 0
        self._tent_b, self._tent_u = np.zeros(n, np.int64), np.zeros(n, np.int64)
        self._tent_pages, self._tent_div = np.zeros((tail, n), np.int64), np.zeros(n, bool)
        self._mine, self._divergence = np.zeros(n, bool), np.full(n, -1, np.int64)
        self.publisher = None   # a tier below that writes through what a finish caches (tiers.shared)
        # share as written: a running request's prompt pages are shared once the pass that
        # completes them is over. The pass only notes that one is over (_note_written); the
        # pages join the tree before anything reads or changes it (_sync: every call of this
        # cache, the `tree` property, a request leaving its slot, a resume point kept on such a
        # page; a capture evicting a resume point needs no sharing first, _need_checkpoint), up
        # to the lengths the last pass over left (Allocator.committed_lengths), so every reader
        # sees what sharing them at the pass's end would have left, and a run of decode passes
        # pays a flag each. Where the order pages are shared in matters (a page another request holds too,
        # a kept resume point waiting for its page: `_twice`, `_unplaced`), they are shared at
        # the pass's end. `_filling` holds the requests with prompt pages still to share,
        # `_coming` counts per key the running requests that will write it
        self.share_as_written = bool(share_as_written)
        self._filling: dict = {}
        # per slot: the length at which its next page to share is complete (NEVER: not filling),
        # so a read of the tree finds the slots with a page to share in one vector comparison,
        # not a loop; the pages it has keys for
        self._fill_due = np.full(n, NEVER, np.int64)
        self._fill_keys = np.zeros(n, np.int64)
        # per slot: its filling request's keys by page past its path (what its sharing reads:
        # _share_due gathers many slots' at once); as many columns as the longest keyed request
        # so far needs (grown by doubling, at most the block table's), not the table's from the
        # start: at 4,096 slots of 1M-token requests that would be another 128 MiB of host memory
        self._slot_keys = np.zeros((n, min(8, allocator.full_table.shape[1])), np.uint64)
        self._paths: list = [None] * n   # per slot: its filling request's path (the same list)
        self._noted = False            # a pass is over since the last _sync: pages may wait
        self._twice: set = set()       # filling slots that may share a page another holds too (_fill)
        self._unplaced: set = set()    # filling slots with a kept resume point whose page is not shared yet
        self._coming: dict = {}
        self._wanted: dict = {}   # slot -> boundaries a later request will leave its pages at (_junction)
        # requests waiting for admission (enqueue): id -> (queue order, the keys a hit may cover);
        # the tree's `awaited` maps each such key to the orders that wait for it
        self._queued: dict = {}
        self._queue_order = 0
        # keep the resume point at the last full page boundary of each prompt that continues
        # cached pages, as a divergence point (admit): the next turn of a conversation resumes
        # there when the answer's pages are not keyed (vLLM keeps the same "replay boundary")
        self.keep_prompt_ends = boolean("keep_prompt_ends", keep_prompt_ends)
        self._recorder: Recorder | None = None   # what it served, for a refit (record())
        allocator.on_capture = self._on_capture
        allocator.on_need_checkpoint = self._need_checkpoint
        allocator.on_need_physical = self._need_physical
        allocator.on_slot_end = self._slot_end

    @property
    def tree(self) -> Tree:
        """The page tree, with every page complete in a pass that is over shared (_sync)."""
        self._sync_written()
        return self._tree

    @property
    def evictor(self):
        return self._tree.evictor

    @evictor.setter
    def evictor(self, value) -> None:
        self._tree.evictor = value

    # ---------------------------------------------------------------- matching
    def prompt_keys(self, token_ids, prompt_tokens: int) -> PromptKeys:
        """The prompt's keys, computed once: give them as `page_keys=` to every can_admit and
        admit (and a tier's prefetch) of this prompt instead of its token_ids."""
        return prompt_keys(token_ids, prompt_tokens, self.P)

    def _keys(self, prompt_tokens, token_ids, keys) -> np.ndarray:
        if isinstance(keys, PromptKeys):
            if keys.prompt_tokens != prompt_tokens or keys.page_tokens != self.P:
                raise KvatlasError(f"page_keys: made for a {keys.prompt_tokens}-token prompt in {keys.page_tokens}-token "
                                   f"pages, asked about a {prompt_tokens}-token prompt in {self.P}-token pages; make "
                                   "them with prompt_keys(token_ids, prompt_tokens) of this cache and prompt")
            if token_ids is not None:
                raise KvatlasError("page_keys: PromptKeys already hold the prompt's content; give them or "
                                   "token_ids, not both")
            return keys.keys
        if keys is not None:
            return check_keys(keys, prompt_tokens, self.P, token_ids)
        if token_ids is None:
            return np.zeros(0, np.uint64)
        if len(token_ids) < prompt_tokens:
            raise KvatlasError(f"token_ids: {len(token_ids)} ids for a {prompt_tokens}-token prompt; give at least "
                               "the prompt's ids")
        return page_keys(token_ids[:prompt_tokens], self.P)

    def _match(self, prompt_tokens, token_ids, keys) -> _Match:
        keys = self._keys(prompt_tokens, token_ids, keys)
        path = self.tree.match(keys)
        cap = min(len(path), (prompt_tokens - 1) // self.P)   # at least one prompt token left to compute
        j, ckpt = cap, self._tree.ckpt
        while j and ckpt[path[j - 1]] is None:
            j -= 1
        writer = None
        if j < cap and self.share_as_written:
            writer, t = self._writer_point(path, j, cap)
            j = max(j, t)
        return _Match(keys, path, j, writer)

    def _writer_point(self, path, j: int, cap: int) -> tuple[int | None, int]:
        """A running request's latest resume point (captured, not yet kept or dropped by the
        policy) on the matched pages past j, up to cap: (its slot, its depth in pages), the
        deepest one; (None, 0) when there is none. Its page is shared already (it is on the
        writer's path), its rows complete (captured once the pass that reached it was over), so
        a reader may resume there exactly as from a kept point: admit keeps it once the
        admission succeeds (_take_writer_point)."""
        if not self._tree.refs[path[j:cap]].any():   # a writer reads every page of its path
            return None, 0
        at = {}
        for slot in np.flatnonzero(self._tent_u).tolist():
            req = self.requests.get(self.alloc.rid_of[slot])
            i = int(self._tent_b[slot]) // self.P
            if req is not None and 0 < i <= len(req.path) and not req.holds_other(i * self.P):
                at[req.path[i - 1]] = slot
        if at:
            for i in range(cap, j, -1):
                slot = at.get(path[i - 1])
                if slot is not None:
                    return slot, i
        return None, 0

    def _take_writer_point(self, slot: int) -> None:
        """A reader resumes at the slot's latest resume point: the policy keeps it now (read
        before its writer moved on, it has shown its worth), on the tree like any kept point."""
        ck = self._tentative(slot)
        self._tent_u[slot] = self._tent_b[slot] = 0
        req = self.requests[self.alloc.rid_of[slot]]
        self.alloc.keep_own_tail(slot, ck.boundary_tokens, ck.swa_pages)   # the writer may still read it
        self._place(ck, req.path, req)
        self.stats.writer_points_read += 1

    def _room(self, m: _Match, total_tokens: int) -> tuple[int, int]:
        """(pages the admission needs, pages it can have: free now + evictable but not its own hit)."""
        need = cdiv(total_tokens, self.P) - m.resume_pages if self.alloc.full is not None else 0
        mine = int(np.count_nonzero(self._tree.refs[m.path[: m.resume_pages]] == 0))
        return need, self.alloc.free_full_pages() + self.tree.idle_pages - mine

    def cached_pages(self, prompt_tokens, *, token_ids=None, page_keys=None) -> int:
        """Leading pages of this prompt the tree holds now (at most those a hit may cover: a token
        is left to compute): what a scheduler that admits resident prefixes first orders by."""
        return len(self.tree.match(self._hit_keys(prompt_tokens, token_ids, page_keys)))

    def _hit_keys(self, prompt_tokens, token_ids, page_keys):
        """The prompt's keys of the pages a hit may cover (a token is left to compute)."""
        return self._keys(prompt_tokens, token_ids, page_keys)[:(prompt_tokens - 1) // self.P]

    def writing_next(self, prompt_tokens, *, token_ids=None, page_keys=None) -> int:
        """Pages of this prompt right past what the cache holds that running requests are still
        to write (pages shared as written): what a request admitted now would compute itself and
        could hit a few passes later. A scheduler may hold it meanwhile (the simulator's
        `hold_for_writers`); the writers are asked to keep their resume point where the prompt
        leaves their pages, so that it resumes there."""
        keys = self._hit_keys(prompt_tokens, token_ids, page_keys)
        if not self._coming:
            return 0
        matched = len(self.tree.match(keys))
        return self._junction(keys, matched) - matched

    def _junction(self, keys, matched: int) -> int:
        """Pages of `keys` past which no running request writes them: `matched` (pages the tree
        holds) when none is writing the next one. The writers still short of that boundary keep
        their resume point there (a divergence point to come, `_wanted`)."""
        end = matched + self._coming_run(keys, matched)
        if end > matched:
            a, k, b = self.alloc, int(keys[end - 1]), end * self.P
            for slot, req in self._filling.items():
                if len(req.keys) >= end and int(req.keys[end - 1]) == k and a.length[slot] < b:
                    self._wanted.setdefault(slot, set()).add(b)
        return end

    def can_admit(self, prompt_tokens, max_new_tokens=0, *, token_ids=None, page_keys=None) -> bool:
        """Counts what eviction would free: never False while eviction could make room."""
        total = self.alloc._validate_lengths(prompt_tokens, max_new_tokens)
        m = self._match(prompt_tokens, token_ids, page_keys)
        need, room = self._room(m, total)
        short = self.alloc._admission_shortfall(total, m.resume_pages)
        if short is None:
            return True
        hit = m.path[:m.resume_pages]
        keep = self._tree.ckpt[hit[-1]] if hit and m.writer is None else None
        if short.pool == "full_pages":   # (as admit decides whether to evict pages for them)
            return need <= room and self._slot_fits(keep, hit)
        if short.pool == "physical":   # (vmm under max_physical_bytes) what eviction would free
            return self._makes_room(keep, hit)
        return False

    # ---------------------------------------------------------------- the waiting queue
    def enqueue(self, request_id, prompt_tokens, *, token_ids=None, page_keys=None) -> None:
        """The request waits for admission, behind those enqueued before it: until it is admitted
        (admit with the same id) or `dequeue`d, eviction takes the pages no waiting request would
        hit first, and of those some would, the page whose first waiting reader is furthest back
        in the queue (kvatlas.prefix.tree). A scheduler calls it as a request joins its queue; a
        request never enqueued is admitted as before. Costs the prompt's keys once and a dict
        entry per page."""
        check_request_id(request_id)
        if request_id in self._queued:
            raise RequestStateError(f"request_id {request_id!r} is queued already; admit or dequeue it first")
        if request_id in self.alloc.slot_of:
            raise RequestStateError(f"request_id {request_id!r} is running; a running request is not queued")
        keys = self._hit_keys(whole("prompt_tokens", prompt_tokens, 1), token_ids, page_keys).tolist()
        self._queue_order += 1
        order, awaited = self._queue_order, self._tree.awaited
        self._queued[request_id] = (order, keys)
        if self._recorder is not None:   # (its arrival: when it began to wait)
            self._recorder.queued(request_id)
        for k in keys:
            waiting = awaited.get(k)
            if waiting is None:
                awaited[k] = {order: None}
            else:
                waiting[order] = None

    def dequeue(self, request_id) -> bool:
        """The request left the queue without being admitted (rejected, cancelled); False if it
        was not queued. admit() dequeues the request it admits itself."""
        if self._recorder is not None:
            self._recorder.left_queue(request_id)
        return self._dequeue(request_id)

    def _dequeue(self, request_id) -> bool:
        entry = self._queued.pop(request_id, None)
        if entry is None:
            return False
        order, keys = entry
        awaited = self._tree.awaited
        for k in keys:
            waiting = awaited[k]
            del waiting[order]
            if not waiting:
                del awaited[k]
        return True

    @property
    def queued(self) -> int:
        """Requests waiting for admission (enqueue)."""
        return len(self._queued)

    # ---------------------------------------------------------------- what it served
    def record(self, max_requests: int = 100_000, clock=time.monotonic) -> None:
        """Keep what the requests admitted from now on ask for (kvatlas.prefix.record): their
        arrival by `clock` (seconds), prompt length and page keys, and the tokens they write; the
        latest `max_requests` finished ones. `served()` returns them; kvatlas.driving.traces
        turns them into a trace the fit replays. Called again, it starts over."""
        self._recorder = Recorder(max_requests, clock, self.P)

    def served(self) -> list:
        """The finished requests recorded since record(), oldest first (kvatlas.prefix.record.Served)."""
        if self._recorder is None:
            raise RequestStateError("served: nothing is being recorded; call record() first")
        return list(self._recorder.served)

    @property
    def served_total(self) -> int | None:
        """Requests finished since record() (more than served() keeps past its bound); None when
        nothing is being recorded."""
        return None if self._recorder is None else self._recorder.finished_total

    # ---------------------------------------------------------------- admission
    def admit(self, request_id, prompt_tokens, max_new_tokens=0, *, token_ids=None, page_keys=None):
        check_request_id(request_id)   # before the match: a refused id must not evict anything
        total = self.alloc._validate_lengths(prompt_tokens, max_new_tokens)
        if request_id in self.alloc.slot_of:
            raise RequestStateError(f"request_id {request_id!r} is already running; finish it first or use a new id")
        m = self._match(prompt_tokens, token_ids, page_keys)
        if isinstance(page_keys, PromptKeys):
            tail = page_keys.tail
        else:
            tail = prompt_tail(token_ids, prompt_tokens, self.P) if token_ids is not None and page_keys is None else None
        j = m.resume_pages
        hit = m.path[:j]
        self.tree.ref(hit)   # protected from the eviction below
        try:
            need, room = self._room(m, total)
            short = self.alloc._admission_shortfall(total, j)
            keep = self._tree.ckpt[hit[-1]] if hit and m.writer is None else None
            if short is not None and short.pool == "full_pages" and need <= room and self._slot_fits(keep):
                self.tree.evict_pages(need - self.alloc.free_full_pages())
                short = self.alloc._admission_shortfall(total, j)
            tries = 0
            while short is not None and short.pool == "physical" and self._need_physical(tries, short, keep):
                tries += 1
                short = self.alloc._admission_shortfall(total, j)
            adm = self.alloc.admit(request_id, prompt_tokens, max_new_tokens, shared=self._shared(hit, m.writer))
        except (KvatlasError, PoolExhaustedError):
            self.tree.unref(hit, self.clock)
            raise
        if self._queued:
            self._dequeue(request_id)   # (the recorder keeps its arrival until admitted() below)
        if m.writer is not None:   # admitted: the writer's point it resumes at is kept from now on
            self._take_writer_point(m.writer)
        self.clock += 1
        ck = self._tree.ckpt[hit[-1]] if hit else None
        if ck is not None:
            self._tree.touch_checkpoint(ck, self.clock)
        slot = adm.request_slot
        self._mine[slot] = True
        # where its prompt leaves the cached path, or, past pages running requests are still to
        # write (share as written), where it leaves theirs: both reach that junction, and the first
        # there keeps its point for the rest
        junction = self._junction(m.keys, len(m.path))
        self._divergence[slot] = junction * self.P if junction > j else -1
        # the prompt's last full page boundary, where the next turn of a conversation resumes when
        # what follows is not keyed (vLLM's replay boundary): kept as a divergence point when the
        # prompt continues cached pages (a conversation past its first turn, likely to go on)
        if self.keep_prompt_ends and len(m.keys) > j and m.path:
            self._wanted.setdefault(slot, set()).add(len(m.keys) * self.P)
        req = self.requests[request_id] = _Request(m.keys, list(hit), prompt_tokens, tail)
        self._count(m, prompt_tokens)
        if self.share_as_written and len(m.keys) > j and self.alloc.full is not None:
            self._fill(slot, req, m.keys[j:])
        self._count_tiers(hit)
        if self._recorder is not None:
            self._recorder.admitted(request_id, prompt_tokens, m.keys)
        return adm

    def _slot_fits(self, keep, held=()) -> bool:
        """An admission short of full pages, which eviction can free: whether its slot's state
        rows are mapped too, or evicting every evictable unit (not `keep`, nor its hit: `held`,
        or referenced once admit holds it) would make room for them. If not, admit evicts no
        page and is refused as it stands, and can_admit says no (before, it evicted the pages,
        then was refused for physical memory after a `can_admit` yes)."""
        short = self.alloc._slot_rows_shortfall()
        return short is None or short.pool != "physical" or self._makes_room(keep, held)

    def _count_tiers(self, hit) -> None:
        s, P, origin = self.stats, self.P, self._tree.origin
        if not origin:   # (nothing came back from a lower tier unread)
            s.device_hit_tokens += P * len(hit)
            return
        for i in hit:
            tier = origin.pop(i, None)
            if tier == "shared":
                s.shared_hit_tokens += P
            elif tier == "host":
                s.host_hit_tokens += P
            else:
                s.device_hit_tokens += P

    def _shared(self, hit, writer=None) -> SharedPrefix | None:
        if not hit:
            return None
        ck = self._tree.ckpt[hit[-1]] if writer is None else self._tentative(writer)
        pages = self._tree.pages_of(hit)
        return SharedPrefix(len(hit) * self.P, pages, ck.swa_pages, ck.unit)

    def _count(self, m: _Match, prompt: int) -> None:
        s, P = self.stats, self.P
        full, cap = prompt // P, (prompt - 1) // P
        matched, j = len(m.path), m.resume_pages
        usable = min(matched, cap)
        s.queried_tokens += prompt
        s.hit_tokens += j * P
        lost = (usable - j) * P
        if usable > j and self._tree.ck_evicted[m.path[usable - 1]]:
            s.missed_evicted += lost
        else:
            s.missed_no_checkpoint += lost
        s.missed_partial_page += prompt - full * P + (P if matched > cap else 0)
        gone = self.tree.evicted_run(m.keys, matched)
        s.missed_evicted += gone * P
        coming = self._coming_run(m.keys, matched + gone)
        s.missed_not_written_yet += coming * P
        s.missed_no_cached_prefix += (full - matched - gone - coming) * P

    def _coming_run(self, keys, start: int) -> int:
        """Pages from `start` that a running request will write and has not shared yet."""
        n, coming = 0, self._coming
        if coming:
            for k in keys[start:].tolist():
                if k not in coming:
                    break
                n += 1
        return n

    # ---------------------------------------------------------------- share as written
    def _note_written(self) -> None:
        """A pass is over: the pages its requests completed are shared at the next read of the
        tree (_sync, which finds them from the lengths committed then), so a pass of a batch with
        pages to share costs a flag, not a comparison over the slots. Only where a page's order
        matters (`_twice`, `_unplaced`, _fill) does a slot completing one share at once."""
        self._noted = True
        if self._twice or self._unplaced:
            due, length = self._fill_due, self.alloc.length
            if any(due[s] <= length[s] for s in (*self._twice, *self._unplaced)):
                self.alloc.commit_pass()
                self._sync()   # its page may free its writer's own, or hold a kept point: now (_fill)

    def _sync_written(self) -> None:
        if self._noted:
            self._sync()

    def _sync(self) -> None:
        """Share the pages complete when the last pass was over (the allocator's committed
        lengths): each joins the tree,
        read-only for everyone and its writer one of their readers. A key the tree has already
        (the same content, shared meanwhile by another request) is read from the tree instead,
        so the request's later pages still hang below it. Resume points at their boundaries
        join as the policy keeps them (_keep_intermediate). The requests whose pages are all new
        to the tree (most) are shared together: the allocator's update in one vector call, then
        per page a node."""
        self._noted = False
        passed = self.alloc.committed_lengths()
        due = self._fill_due <= passed
        slots = due.nonzero()[0]
        if len(slots):
            self._share_due(slots, np.minimum(passed[slots] // self.P, self._fill_keys[slots]))
        if not self._filling:
            self.alloc.on_pass_over = None

    def _share_due(self, slots, ends) -> None:
        """Each slot's pages up to `ends`. The slots whose pages' order matters (`_twice`: one
        another request holds too; `_unplaced`: a kept point waits for its page) go page by page
        (_share_upto); the rest, most, at once: their keys gathered from `_slot_keys` and the
        allocator updated in vector calls, then a node per page, without reading each request."""
        tree, filling, coming, odd = self._tree, self._filling, self._coming, self._twice | self._unplaced
        rest = []
        if odd:
            slow = np.fromiter((s in odd for s in slots.tolist()), bool, len(slots))
            if slow[slow.argmax()]:
                rest = list(zip(slots[slow].tolist(), ends[slow].tolist()))
                slots, ends = slots[~slow], ends[~slow]
        if len(slots):
            a = self.alloc
            starts = a.full_shared[slots]   # (the pages each slot has shared so far: its path)
            counts = ends - starts
            keys = self._slot_keys[spread(slots, counts, starts)].tolist()
            # (no other writer, no cached page: `_twice` marks those; checked, for the tree's sake)
            if len(set(keys)) != len(keys) or not tree.index.keys().isdisjoint(keys):
                rest = sorted(rest + list(zip(slots.tolist(), ends.tolist())))
            else:
                # (each path is the slot's table row up to its shared pages: its last node is
                # the page in the column before, no need to read the path)
                heads = np.where(starts > 0, a.full_table[slots, np.maximum(starts - 1, 0)], -1)
                tree.add_runs(list(map(self._paths.__getitem__, slots.tolist())), counts, keys,
                              a.share_written_runs(slots, starts, ends), self.clock, (heads, starts))
                for k in keys:   # (_unexpect, inline: most keys have one writer)
                    left = coming.pop(k, 0) - 1
                    if left > 0:
                        coming[k] = left
                done = ends == self._fill_keys[slots]
                self._fill_due[slots] = np.where(done, NEVER, (ends + 1) * self.P)
                for slot in slots[done].tolist():
                    del filling[slot]
        for slot, end in rest:
            self._share_upto(slot, end)

    def _share_upto(self, slot: int, end: int) -> None:
        """One request's pages up to `end`, page by page (_sync)."""
        a, P, tree, coming = self.alloc, self.P, self._tree, self._coming
        req = self._filling[slot]
        i = len(req.path)
        for k in self._slot_keys[slot, i:end].tolist():
            node = tree.index.get(k)
            if node is None:
                tree.add_runs((req.path,), (1,), (k,), (a.share_written(slot, i),), self.clock)
            else:
                a.share_written(slot, i, tree.page_of(node))
                tree.ref((node,))
                req.path.append(node)
            self._unexpect(k, coming)
            i += 1
        if req.kept:
            for ck in [ck for ck in req.kept if ck.node is None and ck.boundary_tokens <= i * P]:
                req.kept.remove(ck)   # kept before its page was shared: it joins now
                self._place(ck, req.path, req)
            if not any(ck.node is None for ck in req.kept):
                self._unplaced.discard(slot)
        if i == len(req.keys):   # (a point kept past its keys waits for the finish, _publish)
            del self._filling[slot]
            self._fill_due[slot] = NEVER
            self._twice.discard(slot)
            self._unplaced.discard(slot)
        else:
            self._fill_due[slot] = (i + 1) * P

    def _fill(self, slot: int, req, new_keys) -> None:
        """The slot's request has pages past its path to share as it writes them, `new_keys`
        among them newly expected. Where another request writes one of them too, or the tree
        holds it (no resume point there), sharing it frees the later writer's own page: the
        slots that may meet such a page are marked, and a pass in which one completes a page
        shares at once (_note_written), so that the freed page is free for the next pass's
        allocations exactly as when every pass shared its pages."""
        coming, nodes, twice, new = self._coming, self._tree.index, [], new_keys.tolist()
        for k in new:
            n = coming[k] = coming.get(k, 0) + 1
            if n > 1 or k in nodes:
                twice.append(k)
        shared = len(req.path)   # (the keys past the pages it shared: what its sharing reads)
        if len(req.keys) > self._slot_keys.shape[1]:
            width = min(max(len(req.keys), 2 * self._slot_keys.shape[1]), self.alloc.full_table.shape[1])
            grown = np.zeros((len(self._slot_keys), width), np.uint64)
            grown[:, :self._slot_keys.shape[1]] = self._slot_keys
            self._slot_keys = grown
        self._slot_keys[slot, shared:len(req.keys)] = req.keys[shared:]
        self._filling[slot] = req
        self._paths[slot] = req.path
        if req.kept:   # (points kept past the keys it had: placed as their pages are shared now)
            self._unplaced.add(slot)
        self._fill_due[slot] = (shared + 1) * self.P
        self._fill_keys[slot] = len(req.keys)
        self.alloc.on_pass_over = self._note_written
        if twice:
            self._mark_twice(twice)

    def _mark_twice(self, keys) -> None:
        """Mark the filling slots still to share one of `keys` (see _fill)."""
        keys = set(keys)
        for slot, req in self._filling.items():
            if slot not in self._twice and not keys.isdisjoint(self._slot_keys[slot, len(req.path):len(req.keys)].tolist()):
                self._twice.add(slot)

    @staticmethod
    def _unexpect(k, coming) -> None:
        left = coming.get(k, 0) - 1
        if left > 0:
            coming[k] = left
        else:
            coming.pop(k, None)

    def _stop_filling(self, slot: int) -> None:
        self._wanted.pop(slot, None)
        self._twice.discard(slot)
        self._unplaced.discard(slot)
        req = self._filling.pop(slot, None)
        self._fill_due[slot] = NEVER
        self._paths[slot] = None
        if req is not None:
            for k in req.keys[len(req.path):].tolist():
                self._unexpect(k, self._coming)
            if not self._filling:
                self.alloc.on_pass_over = None

    # ---------------------------------------------------------------- resume points
    def _on_capture(self, slots, boundaries, units, swa_pages) -> None:
        """Captures of distinct slots, one batch: each slot's previous point is kept or dropped
        (the policy), the new one becomes its tentative point."""
        mine = self._mine.take(slots)
        if not mine[mine.argmin()]:   # requests admitted past the cache: nothing of theirs is kept
            self._drop_many(units[~mine], swa_pages[:, ~mine])
            slots, boundaries, units, swa_pages = slots[mine], boundaries[mine], units[mine], swa_pages[:, mine]
            if not len(slots):
                return
        prev = self._tent_u.take(slots)
        if prev[prev.argmax()]:   # (argmax/argmin: cheaper than any()/all() on a few values)
            had = prev.astype(bool)
            keep = had & self.policy.keep(self._tent_div.take(slots), self._tent_b.take(slots) // self.P)
            drop = had ^ keep
            if drop[drop.argmax()]:
                self._drop_many(prev[drop], self._tent_pages.take(slots[drop], axis=1))
            if keep[keep.argmax()]:
                for i in keep.nonzero()[0].tolist():
                    self._keep_intermediate(int(slots[i]), self._tentative(int(slots[i])))
        self._tent_b[slots], self._tent_u[slots] = boundaries, units
        for j, row in enumerate(self._tent_pages):   # row by row: 1-D stores cost a fraction of 2-D
            row[slots] = swa_pages[j]
        self._tent_div[slots] = boundaries == self._divergence.take(slots)
        if self._wanted:   # junctions a later request revealed ahead of the writer (_junction)
            for i, slot in enumerate(slots.tolist()):
                want = self._wanted.get(slot)
                if want and int(boundaries[i]) in want:
                    want.discard(int(boundaries[i]))
                    self._tent_div[slot] = True
        if self.share_as_written:   # what the policy keeps anyway is kept now: readers may resume there
            now = self.policy.keep(self._tent_div.take(slots), boundaries // self.P)
            if now[now.argmax()]:
                for slot in slots[now].tolist():
                    ck = self._tentative(slot)
                    self.alloc.keep_own_tail(slot, ck.boundary_tokens, ck.swa_pages)   # it may still read it
                    self._keep_intermediate(slot, ck)
                self._tent_u[slots[now]] = 0

    def _tentative(self, slot: int):
        """The slot's tentative point as a Checkpoint (None if it has none)."""
        if not self._tent_u[slot]:
            return None
        ck = Checkpoint(int(self._tent_b[slot]), int(self._tent_u[slot]), self._tent_pages[:, slot].copy())
        ck.divergence = bool(self._tent_div[slot])
        return ck

    def _keep_intermediate(self, slot: int, ck) -> None:
        req = self.requests[self.alloc.rid_of[slot]]
        if self._noted and ck.boundary_tokens // self.P > len(req.path):
            self._sync()   # its page may be one a pass over has noted: shared first, as at the pass's end
        if ck.boundary_tokens // self.P <= len(req.path) and self.share_as_written:
            self._place(ck, req.path, req)   # its page is shared already: readers may resume there now
            return
        req.kept.append(ck)
        if slot in self._filling:   # (placed as its page is shared, at a pass's end: _note_written)
            self._unplaced.add(slot)
        if not ck.divergence:
            self._intermediate.append((req, ck))

    def _slot_end(self, slot: int) -> None:
        """The slot's request is gone (finish() has taken its tentative point already; a request
        finished on the allocator directly leaves nothing to keep, but the pages it shared as it
        wrote them stay cached)."""
        self._sync_written()
        self._stop_filling(slot)
        if self._tent_u[slot]:
            self._drop_many(self._tent_u[slot:slot + 1], self._tent_pages[:, slot:slot + 1])
        self._tent_u[slot] = self._tent_b[slot] = 0
        self._mine[slot] = False
        rid = self.alloc.rid_of[slot]
        req = self.requests.pop(rid, None)
        if self._recorder is not None:   # (served all the same: its prompt was asked for)
            self._recorder.finished(rid, int(self.alloc.length[slot]))
        if req is not None:   # finished past the cache: its prefix stops being read
            for ck in req.kept:
                self._drop(ck)
            self.tree.unref(req.path, self.clock)

    def _need_checkpoint(self, keep=None) -> bool:
        """A capture finds no free unit: evict a cached resume point, or else drop an intermediate
        one a running request kept (never its end or a divergence point), so that the points the
        policy values most still find room. The pages passes noted stay noted: no placed point
        waits for them (a point kept on such a page is shared at its pass's end, `_unplaced`), so
        which point goes, and what it frees, is what sharing them first would leave."""
        if self._tree.evict_checkpoint(keep):
            return True
        while self._intermediate:   # oldest first; entries of finished requests are stale
            req, ck = self._intermediate.popleft()
            if ck.node is None and ck.unit > 0 and ck in req.kept:
                req.kept.remove(ck)
                self._drop(ck)
                return True
        return False

    def _need_physical(self, tries: int, short=None, keep=None) -> bool:
        """The backing is out of physical memory (vmm under max_physical_bytes): evict what no
        running request reads, 1, 2, 4, … pages a try in eviction order (the caller asks again
        after each; a page given back frees an id in a mapped chunk, and a chunk it empties is
        given up for room), then resume points one a try, never `keep` (the point an admission
        in progress resumes at). False when nothing is left to evict. Without it, cached pages
        held every chunk the cap allows and nothing was ever admitted again. `short` (the
        refusal, at the first try): nothing is evicted unless evicting everything evictable
        would free the chunks it misses (`_makes_room`), so a refusal eviction cannot mend
        leaves the cache as it was (it used to empty the cache first, for nothing)."""
        if tries == 0 and short is not None and not self._makes_room(keep):
            return False
        if self._tree.evict_pages(1 << min(tries, 30)):
            return True
        return self._need_checkpoint(keep)

    def _makes_room(self, keep=None, held=()) -> bool:
        """Whether evicting every unit eviction may take (`_evictable`: not `keep`, nor the pages
        `held`, an admission's hit) would let the units just refused for physical memory fit.
        Exact on the vmm backend under its cap (`ChunkMap.fits_after`: the chunks that eviction
        empties, and the ids it frees, which lowest-first placement hands out next); otherwise
        (the device out of memory), whether anything is evictable."""
        backing = self.alloc.backing
        refused = getattr(backing, "refused", None)
        if refused is None:
            return self._evictable_units()
        return backing.fits_after(refused, self._evictable(keep, held), self.alloc.lowest_free)

    def _evictable(self, keep=None, held=()) -> list:
        """(index space, unit ids) of what evicting everything evictable now would give back:
        the full pages no running request reads (not `held`), the units of every resume point on
        the tree and of the intermediate ones running requests kept (not `keep`), and the SWA
        pages of those points nobody else holds (no window reads them, no other capture pins
        them, `keep` does not share them)."""
        t = self._tree   # (not `tree`: sharing what passes wrote is not this question's to do)
        n = min(t.base, len(t.refs))
        pages = np.flatnonzero((t.depth[:n] > 0) & (t.refs[:n] == 0))
        if len(held) and len(pages):
            pages = pages[~np.isin(pages, np.asarray(held, np.int64))]
        points = [ck for ck in t.ckpt if ck is not None and ck is not keep]
        seen, inter, live = set(), [], deque()
        for req, ck in self._intermediate:   # stale entries (placed, dropped, evicted) go now
            if ck.node is None and ck.unit > 0 and id(ck) not in seen and ck in req.kept:
                seen.add(id(ck))
                live.append((req, ck))
                if ck is not keep:
                    inter.append(ck)
        self._intermediate = live
        out = [(FULL_PAGES, pages), (CHECKPOINTS, np.array([ck.unit for ck in points + inter], np.int64))]
        a = self.alloc
        if a.swa is not None and (points or inter):
            cand = np.unique(np.concatenate([np.asarray(ck.swa_pages, np.int64).ravel() for ck in points + inter]))
            pins = np.zeros(len(a.swa_refs), np.int64)   # an intermediate point holds a pin on each page
            for ck in inter:
                np.add.at(pins, np.asarray(ck.swa_pages, np.int64).ravel(), 1)
            cand = cand[(cand > 0) & (a.swa_refs[cand] == pins[cand])]
            if keep is not None and len(cand):
                cand = cand[~np.isin(cand, np.asarray(keep.swa_pages, np.int64).ravel())]
            out.append((SWA_PAGES, cand))
        return out

    def _evictable_units(self) -> bool:
        """Whether the cache holds anything eviction could give back (pages no running request
        reads, resume points): whether an admission short of physical memory may find room."""
        tree = self.tree
        return bool(tree.idle_pages or tree.checkpoints or self._intermediate)

    def _drop(self, ck) -> None:
        self._drop_many(np.array([ck.unit], np.int64), np.asarray(ck.swa_pages, np.int64))
        ck.unit = -1

    def _drop_many(self, units, swa_pages) -> None:
        if len(units):
            self.alloc.release_checkpoints(units, swa_pages, pinned=True)
            self.stats.checkpoints_dropped += len(units)

    def generated(self, request_id, token_ids) -> int:
        """The request's sequence so far (its prompt, then the tokens it generated and kept): its
        full pages past the prompt, written in passes that are over, get their keys and are shared
        as written (at the end of the pass, as its prompt pages are). Pages the last write touched
        wait for the next call: its drafts may still be rolled back. Ids must agree with the
        admitted prompt and with what earlier calls gave (ContentMismatchError, nothing changed);
        a call that keys no new page checks nothing. Returns the pages keyed so far. Cost: the prompt hashed once, at the first call; then the
        new pages only."""
        self._sync_written()
        check_request_id(request_id)
        a = self.alloc
        if request_id not in a.slot_of or request_id not in self.requests:
            raise RequestStateError(f"request_id {request_id!r} is not running in this cache; give a running request")
        req, slot = self.requests[request_id], a.slot_of[request_id]
        ids = as_tokens(token_ids)
        committed = min(a.committed_lengths(slot), len(ids))
        pages = committed // self.P
        if not self.share_as_written or a.full is None or pages <= len(req.keys) \
                or len(req.keys) < req.prompt_tokens // self.P:   # (admitted with fewer keys than pages)
            return len(req.keys)
        if req.ids is None:
            keys = verified_keys(req.keys, req.tail, req.prompt_tokens, ids, pages * self.P, self.P)
        else:
            n = len(req.ids)
            if not np.array_equal(ids[:n], req.ids):
                raise ContentMismatchError(f"token_ids: id {int(np.argmax(ids[:n] != req.ids))} differs from what "
                                           "was given before; give the request's sequence as written")
            keys = np.concatenate((req.keys, page_keys(ids[n: pages * self.P], self.P, int(req.keys[-1]))))
        new = keys[len(req.keys):]
        req.keys, req.ids = keys, ids[: pages * self.P].copy()
        self._fill(slot, req, new)
        return len(keys)

    # ---------------------------------------------------------------- a request takes another's content
    def copy_contents(self, src_ids, dst_ids) -> None:
        """Each dst request now holds what the src at its place holds (KVCache.copy_contents: beam
        search), so what it may publish goes with the content: it takes the src's prompt (keys,
        ids past them, divergence point) and finish-time ids are checked against that. The resume
        points it saved itself hold its old content wherever that differs from the new one: from
        its first page whose key differs (anything past the prompt's keys is unknown, so differs)
        up to the last boundary whose rows it has begun writing. They are dropped when it
        finishes, not now: its window may still read their SWA pages (Sharing._pin_tails)."""
        self._sync_written()
        a = self.alloc
        def prompt(r):   # a copy of what it may publish: a swap writes one pair's src as the other's dst
            req = self.requests.get(r)
            if req is None:
                return None
            took = _Request(req.keys, None, req.prompt_tokens, req.tail)
            took.ids = req.ids
            return took
        took = [(prompt(r), int(self._divergence[a.slot_of[r]])) for r in src_ids]   # all read first
        for (src, div), rid in zip(took, dst_ids):
            slot = a.slot_of[rid]
            self._divergence[slot] = div
            req = self.requests.get(rid)
            if req is None:   # admitted past the cache: it publishes nothing
                continue
            keys = src.keys if src is not None else np.zeros(0, np.uint64)
            n = min(len(keys), len(req.keys))
            differ = (keys[:n] != req.keys[:n]).nonzero()[0]
            same = (int(differ[0]) if len(differ) else n) * self.P
            written = int(a.length[slot]) + a.resume_tokens - 1   # a boundary whose rows were begun
            req.same_tokens = same if not req.stale_tokens else min(same, req.same_tokens)
            req.stale_tokens = max(req.stale_tokens, written)
            old = req.keys[len(req.path):]
            if src is None:   # a src the cache never knew: no content to check ids against
                req.keys, req.tail, req.ids = keys, None, None
            else:
                req.keys, req.tail, req.prompt_tokens, req.ids = src.keys, src.tail, src.prompt_tokens, src.ids
            self._refill(slot, req, old)

    def _refill(self, slot: int, req, old) -> None:
        """After copy_contents: the pages the request has yet to share are those of its new keys
        past the ones it shared already (which copy_contents requires to be the src's too)."""
        self._wanted.pop(slot, None)   # junctions of its old content
        self._twice.discard(slot)
        self._unplaced.discard(slot)
        for k in old.tolist():
            self._unexpect(k, self._coming)
        self._filling.pop(slot, None)
        self._fill_due[slot] = NEVER
        if not self.share_as_written or self.alloc.full is None or len(req.keys) <= len(req.path):
            if not self._filling:
                self.alloc.on_pass_over = None
            return
        self._fill(slot, req, req.keys[len(req.path):])

    # ---------------------------------------------------------------- finish: publish
    def finish(self, request_id, token_ids=None) -> None:
        """Finish a request; its full pages and kept resume points join the tree. token_ids (the
        prompt and what was generated) key the pages past the prompt; without them only the
        prompt's pages are cached. Ids that differ from the admitted prompt are refused
        (ContentMismatchError) before anything changes: the pages hold the admitted content."""
        self._sync_written()
        check_request_id(request_id)
        a = self.alloc
        if request_id not in a.slot_of:
            raise RequestStateError(f"request_id {request_id!r} is not running (never admitted or already "
                                    "finished); finish each request once")
        req = self.requests[request_id]
        slot = a.slot_of[request_id]
        L = int(a.length[slot])
        keys = req.keys
        if token_ids is not None:
            keys = verified_keys(keys, req.tail, req.prompt_tokens, token_ids, L, self.P)
        a._commit_captures([slot])   # the last pass's resume points, while the request is known
        self._stop_filling(slot)
        del self.requests[request_id]
        end = self._tentative(slot)
        self.clock += 1
        if end is not None:
            end.end = True
            req.kept.append(end)
            self._tent_u[slot] = self._tent_b[slot] = 0
        else:
            self._mark_end(req, L // self.P)
        written = keys[: min(L // self.P, len(keys))]   # the keys of its full pages
        if self._recorder is not None:
            self._recorder.finished(request_id, L, written)
        keep_cols, nodes = self._publish(slot, written)
        self._cached_now(keys[: len(nodes)].tolist())
        a.finish(request_id, keep_pages=keep_cols)
        placed = [ck for ck in req.kept if self._place(ck, nodes, req)]
        self._finishes += 1
        if self.policy.refit and self._finishes % REFIT_FINISHES == 0:
            self._refit()
        if self.publisher is not None:   # before unref: no eviction can take these pages yet
            self.publisher.on_publish(nodes, placed)
        self.tree.unref(req.path, self.clock)
        if nodes:   # (a plan without full pages keeps only the nodes a resume point needs: Tree.prune)
            self.tree.prune(nodes[-1])

    def _refit(self) -> None:
        """The spacing fitted to what the cache holds: its pages, against the resume points the
        plan keeps (`prefix_checkpoints`; running requests' captures have units of their own) less
        the ends and divergence points on the tree (they stay: intermediate points go first)."""
        room = self.alloc.plan.options.prefix_checkpoints - self.tree.marked
        self.policy = refitted(self.policy, len(self.tree.index), room)
        self.tree.policy = self.policy

    def _mark_end(self, req, pages: int) -> None:
        """The request ends at a point kept when captured (share as written): it is an end."""
        ck = req.kept[-1] if req.kept else None
        if ck is None or ck.boundary_tokens != pages * self.P:
            ck = self._tree.ckpt[req.path[pages - 1]] if 0 < pages <= len(req.path) else None
        if ck is not None and not ck.end:
            self.tree.mark_end(ck, self.clock)

    def _publish(self, slot, keys) -> tuple[list, list]:
        """Walk the request's pages; make nodes for the ones the tree lacks (kept, not freed)."""
        tree, a = self.tree, self.alloc
        nodes, keep, parent = [], [], None
        shared = int(a.full_shared[slot]) if a.full is not None else 0
        for i, k in enumerate(keys.tolist()):
            node = tree.index.get(k)
            if node is None:
                page = int(a.full_table[slot, i]) if a.full is not None else -1
                if i < shared:    # a page it read was evicted meanwhile: cannot be (it held a reference)
                    raise KvatlasError("prefix tree lost a page a running request reads")
                if a.full is not None:
                    keep.append(i)
                node = tree.add(k, parent, page, self.clock)
            nodes.append(node)
            parent = node
        return keep, nodes

    def _place(self, ck, nodes, req) -> bool:
        i = ck.boundary_tokens // self.P - 1
        if i >= len(nodes) or self._tree.ckpt[nodes[i]] is not None or req.holds_other(ck.boundary_tokens):
            self._drop(ck)   # no key for that page, another request saved this point first, or other content
            return False
        self.alloc.unpin_checkpoint(ck.swa_pages)
        self.tree.attach(nodes[i], ck, self.clock)
        self.stats.checkpoints_saved += 1
        return True

    # ---------------------------------------------------------------- restored from a lower tier
    def _chain(self, key) -> list:
        tree = self.tree
        i, out = tree.index.get(key, -1), []
        while i >= 0:
            out.append(i)
            i = int(tree.parent[i])
        return out

    def restore_pages(self, parent_key, keys, origins=None) -> np.ndarray:
        """Cache-held storage for pages coming back from the host tier, linked under parent_key
        (0: the root); the caller copies their bytes in. Evicts (LRU leaves first, never the
        parent's chain) when short; raises PoolExhaustedError with nothing changed otherwise.
        origins: per key, the tier it comes from ("host" or "shared"; default "host"), counted
        when an admission first reads it (PrefixStats)."""
        keys = [int(k) for k in keys]
        if parent_key and parent_key not in self.tree.index:
            raise KvatlasError(f"restore_pages: parent_key {parent_key} is not cached; restore from the root down")
        if any(k in self.tree.index for k in keys) or len(set(keys)) != len(keys):
            raise KvatlasError("restore_pages: a key is cached already or given twice; restore missing pages once")
        chain = self._chain(parent_key) if parent_key else []
        self.tree.ref(chain, read=False)   # (held through the eviction below, not read)
        try:
            short = len(keys) - self.alloc.free_full_pages()
            if short > 0:
                self.tree.evict_pages(short)
            pages = self.alloc.take_cached_full(len(keys))
        finally:
            self.tree.unref(chain, self.clock)
        self.clock += 1
        node = self.tree.index.get(parent_key) if parent_key else None
        for k, p, origin in zip(keys, pages.tolist(), origins if origins is not None else ["host"] * len(keys)):
            node = self.tree.add(k, node, p, self.clock)
            self.tree.origin[node] = origin
        self._cached_now(keys)
        return pages

    def _cached_now(self, keys) -> None:
        """Keys now on the tree: a running request still to share one of them will read it
        instead of its own page (_fill)."""
        if self._filling:
            twice = [k for k in keys if k in self._coming]
            if twice:
                self._mark_twice(twice)

    def restore_checkpoint(self, key, boundary_tokens: int) -> tuple[int, np.ndarray]:
        """Cache-held storage for a resume point coming back from the host tier, on the cached
        page `key` (its boundary): (checkpoint unit, SWA pages). Evicts other resume points when
        none is free."""
        tree = self.tree
        node = tree.index.get(int(key))
        if node is None or tree.ckpt[node] is not None or boundary_tokens != int(tree.depth[node]) * self.P:
            raise KvatlasError(f"restore_checkpoint: page {key} is not cached without a resume point at "
                               f"{boundary_tokens} tokens; restore its pages first")
        tail = self.alloc.tail_swa_pages if self.alloc.swa is not None else 0
        if self.alloc.ckpt.free < 1:
            self.alloc.spare_checkpoint_units()
        while (self.alloc.ckpt.free < 1 or (tail and self.alloc.swa.free < tail)) and self.tree.evict_checkpoint():
            pass
        tree.ref([node], read=False)   # (held through an eviction for physical memory, not read)
        try:
            unit, pages = self.alloc.take_cached_checkpoint()
        finally:
            tree.unref([node], self.clock)
        self.clock += 1
        self.tree.attach(node, Checkpoint(boundary_tokens, unit, pages), self.clock)
        return unit, pages

    # ---------------------------------------------------------------- reports
    # They read, never change: a scrape may run on another thread. Pages a pass over completed
    # and the tree has yet to take (_sync) count as their writer's, as the ledger counts them,
    # until the cache's next call (an admission, a finish) or a read of `tree` shares them.
    def cached_bytes(self) -> int:
        """Payload the cache holds: its pages, and per resume point its unit and SWA tail pages
        (orphaned tail pages, still read by a running request, count as that request's)."""
        page, unit, swa = self._unit_payload
        t = self._tree
        return len(t.index) * page + t.checkpoints * (unit + self.alloc.tail_swa_pages * swa)

    @property
    def _unit_payload(self) -> tuple[int, int, int]:
        by = {FULL_PAGES: 0, CHECKPOINTS: 0, SWA_PAGES: 0}
        for b in self.alloc.plan.buffers:
            if b.group in by:
                by[b.group] += b.unit_payload_bytes
        return by[FULL_PAGES], by[CHECKPOINTS], by[SWA_PAGES]

    def problems(self) -> list[str]:
        """The tree, references and evictable units against a recount (kvatlas.prefix.integrity)."""
        from .integrity import prefix_problems
        return prefix_problems(self)

    def summary(self) -> dict:
        t = self._tree
        return {"policy": self.policy.name, "nodes": len(t.index), "cached_pages": len(t.index),
                "idle_pages": t.idle_pages, "checkpoints": t.checkpoints, "cached_bytes": self.cached_bytes(),
                "queued_requests": len(self._queued), **self.stats.as_dict()}
