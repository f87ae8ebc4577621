"""Every public call of a cache with the prefix cache, the host tier and a shared tier, as one
stateful property test (issue 33): admit (shared system prompts, follow-up turns, fresh prompts,
bursts), prefill chunks grouped in passes, decode steps with drafts and rollback, beams stepped
together whose contents `copy_contents` moves (one way or swapped) and that end anywhere, finish
with the right ids, without ids, or with the ids a copied request was admitted with (another
content's: refused with nothing changed), cut short, flush, evict everything (to the host tier,
whose LRU drops into the shared store), prefetch through host and store at every admission, and
another process on the same store restoring a finished conversation.

After every rule: every book of every cache and tier against a recount (check_integrity), every
running request reads what its cold twin reads (test_prefix_concurrency), and every page and
resume point either cache holds in its prefix tree holds exactly the bytes a cold run of its
key's content computes (`ColdRuns`: a cache that never hits runs the content from token 0, its
rows written by prefix_model from the token ids). A key nobody gave with content fails too.

Every example starts with two beams of two prompts. Before the issue 33 fix, a copy of one into
the other followed by the destination's finish published the source's KV under the
destination's keys (or, finished with what it holds, was refused): this machine found it in
its CI examples. KVATLAS_SLOW_TESTS=1 runs 40 examples of 40 rules."""

import os
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from kvatlas import allocate, plan
from kvatlas.alloc.sharing import CACHE_OWNER
from kvatlas.driving.simwrite import _row_format
from kvatlas.errors import RequestStateError
from kvatlas.prefix import page_keys
from kvatlas.prefix.keys import ContentMismatchError
from kvatlas.tiers.shared import attach_shared_tier
from kvatlas.tiers.shared.memory_store import MemoryStore
from prefix_model import Model, prefix_hashes
from test_prefix_concurrency import CHUNK, DRAFTS, OPTIONS, REQUESTS, VOCAB, Concurrency, _Req
from test_prefix_verify import state

SLOW = os.environ.get("KVATLAS_SLOW_TESTS") == "1"
HOST = "4MiB"   # a few pages: evictions go on down to the store


def _raw(t) -> torch.Tensor:
    """A copy of the tensor's bytes (never a view: the pools are written on after)."""
    return t.contiguous().view(torch.uint8).cpu().clone()


def _groups(cache) -> dict:
    return {b.name: b.group for b in cache.plan.buffers}


def _stored_bytes(cache, name: str) -> int:
    """Bytes of a page that its entries fill: the rows, then their scales. The pad bytes after
    them (alignment) are never written, so they hold whatever the memory held before."""
    p = cache.pools[name]
    if p.role not in ("kv", "indexer"):
        return p.tensor.shape[-1]
    fmt = _row_format(cache.plan, p.spec)
    return p.spec.entries_per_unit * (fmt.data_bytes + fmt.scale_bytes)


def unit_bytes(cache, group: str, unit: int) -> dict:
    """The bytes of one unit (a full page, an SWA page) in every pool of that group."""
    g = _groups(cache)
    return {n: _raw(p.tensor[unit][..., :_stored_bytes(cache, n)]) for n, p in cache.pools.items()
            if g.get(n) == group and p.role != "table"}


def ring_rows(pool, slot: int, positions) -> torch.Tensor:
    """The rows of `positions` in a request slot's ring (a state ring, or V4.1's window rows)."""
    if pool.role == "window":
        ring = pool.spec.entries_per_unit
        rows = pool.tensor[slot].view(len(pool.layers), ring, -1)
    else:
        ring, rows = pool.ring_rows, pool.tensor[slot]
    return _raw(rows[:, [p % ring for p in positions]])


class Inline:
    """An executor that runs each call at once on the calling thread. The store's threads are
    swapped for it so that every put and read has landed when its call returns: a run is then the
    same each time (hypothesis replays and shrinks it), none misses a deadline on a loaded
    machine. Puts and reads still go through the tier's own code (headers, checksums, the
    outbox, the breaker); their timing is the live tests' subject, not this one's."""

    def submit(self, fn, *args):
        f = Future()
        try:
            f.set_result(fn(*args))
        except BaseException as e:   # noqa: BLE001 (handed to the caller, as a pool's future does)
            f.set_exception(e)
        return f

    def shutdown(self, wait=True, cancel_futures=False) -> None:
        pass


def shared_link(cache, store):
    link = attach_shared_tier(cache, HOST, store, checkpoint_share=0.5, outbox_bytes="2MiB")
    for pool in (link.shared._reads, link.shared._writes):
        pool.shutdown()
    link.shared._reads = link.shared._writes = Inline()
    return link


class ColdRuns:
    """What a cold run of a content computes, per page key: the page's entries in every pool, and
    the resume point at its end (the saved rows of the rings, the SWA pages of its tail). Keys are
    content hashes, so each is run once."""

    def __init__(self, hot) -> None:
        self.ref = allocate(plan(hot.plan.model, "8MiB", **{**OPTIONS, "max_running_requests": 1}))
        self.model = Model(self.ref)
        a = hot.allocator
        self.P, self.tail = a.P, a.tail_swa_pages
        self.saved = {n.split(".", 1)[1]: p.spec.entries_per_unit for n, p in hot.pools.items()
                      if p.role == "checkpoint"}
        self.content: dict = {}   # key -> (ids, pages it covers)
        self.pages: dict = {}
        self.points: dict = {}

    def learn(self, ids) -> None:
        ids = np.asarray(ids, np.int64)
        for i, k in enumerate(page_keys(ids, self.P).tolist()):
            self.content.setdefault(k, (ids, i + 1))

    def expected(self, key: int):
        if key not in self.pages:
            assert key in self.content, f"page key {key} is cached but was never given with any content"
            self._run(*self.content[key])
        return self.pages[key], self.points[key]

    def _run(self, ids, depth: int) -> None:
        c, a, P = self.ref, self.ref.allocator, self.P
        n = depth * P
        keys, h = page_keys(ids[:n], P).tolist(), prefix_hashes(ids[:n])
        c.admit("cold", n, 0)
        slot = a.slot_of["cold"]
        for i in range(depth):
            self.model.write(c.extend("cold", P), h[i * P:(i + 1) * P])
            b = (i + 1) * P
            self.pages[keys[i]] = unit_bytes(c, "full_pages", int(a.full_table[slot, i]))
            point = {f"ckpt.{n}": ring_rows(c.pools[n], slot, range(b - rows, b)) for n, rows in self.saved.items()}
            lo = b // a.Ps - self.tail
            for j in range(self.tail):
                point.update({f"{n}[{j}]": v for n, v in
                              unit_bytes(c, "swa_pages", int(a.swa_table[slot, (lo + j) % a.ring])).items()})
            self.points[keys[i]] = point
        c.finish("cold")

    def check(self, cache, where: str) -> int:
        """Every page and resume point in the cache's tree against the cold run of its key."""
        for node in sorted(cache.prefix.tree.nodes.values(), key=lambda n: -n.depth):   # deepest first:
            # one cold run of a content gives every page and resume point above it too
            page, point = self.expected(node.key)
            got = unit_bytes(cache, "full_pages", node.page)
            for n, want in page.items():
                assert torch.equal(got[n], want), f"{where}: page {node.key} (depth {node.depth}) {n} differs"
            ck = node.checkpoint
            if ck is None:
                continue
            got = {n: _raw(cache.pools[n].tensor[ck.unit]) for n in point if n.startswith("ckpt.")}
            for j, page_id in enumerate(ck.swa_pages.tolist()):
                got.update({f"{n}[{j}]": v for n, v in unit_bytes(cache, "swa_pages", page_id).items()})
            assert got.keys() == point.keys(), where
            for n, want in point.items():
                assert torch.equal(got[n], want), f"{where}: resume point at {ck.boundary_tokens} ({node.key}) {n} differs"
        return len(cache.prefix.tree.nodes)


_RUNS: list = []   # one ColdRuns for every example: a content's cold run is the same in each


class EveryCall(Concurrency):
    HOST = HOST
    SHARE_AS_WRITTEN = True   # the default; a subclass shares at finish, where two prompts' beams may copy
    WARM = ()   # the rules' first admissions of the system prompts warm the cache

    def _tiers(self):
        self.store = MemoryStore()
        if not _RUNS:
            _RUNS.append(ColdRuns(self.hot))
        self.runs = _RUNS[0]
        self.beams: set = set()
        self.reader = self.reader_link = None
        self.copies = self.refused = 0
        self.hot.prefix.share_as_written = self.SHARE_AS_WRITTEN
        return shared_link(self.hot, self.store)

    # ---------------------------------------------------------------- beams: stepped together, copied
    def _decoding(self):
        return [rid for rid in super()._decoding() if rid not in self.beams]

    def _prefilling(self):
        return [rid for rid in super()._prefilling() if rid not in self.beams]

    BEAMS = dict(kind=st.sampled_from(["fresh", "fresh", "system0"]), same=st.booleans(), extra=st.integers(1, 400),
                 out=st.integers(1, 24), seed=st.integers(0, 2**31))

    @initialize(extra=st.integers(256, 500), out=BEAMS["out"], seed=BEAMS["seed"])
    def first_beams(self, extra, out, seed):
        """Every example starts with two beams of two prompts, a page or more each: copy_contents
        is open from its first rule, and what they may publish differs."""
        self._beams("fresh", False, extra, out, seed)

    @precondition(lambda self: len(self.running) < REQUESTS - 1)
    @rule(**BEAMS)
    def admit_beams(self, kind, same, extra, out, seed):
        self._beams(kind, same, extra, out, seed)

    def _beams(self, kind, same, extra, out, seed):
        """Two requests of one length (one prompt, or two), prefilled side by side: beams."""
        first = self.n
        for i in range(2):
            self.admit(kind, extra, out, seed + (0 if same else i))
        rids = [f"r{i}" for i in range(first, self.n) if f"r{i}" in self.running]
        self.beams.update(rids)
        while any(self.running[r].written < self.running[r].prompt for r in rids):
            with self.hot.allocator.forward(), self.cold.allocator.forward():
                for rid in rids:
                    r = self.running[rid]
                    n = min(CHUNK // 2, r.prompt - r.written)
                    if n:
                        self._write(lambda c: c.extend(rid, n))
                        r.written += n

    @precondition(lambda self: bool(self.beams))
    @rule(data=st.data())
    def end_beam(self, data):
        """Beam search drops a beam, or one ends: it finishes wherever it is."""
        self._finish(data.draw(st.sampled_from(sorted(self.beams))))

    @precondition(lambda self: any(self.running[r].decoding for r in self.beams))
    @rule(tokens=st.integers(1, 1 + DRAFTS), accepted=st.integers(1, 1 + DRAFTS))
    def beam_step(self, tokens, accepted):
        """The beams decode in one step: each writes `tokens` (1 + drafts) and keeps `accepted`."""
        group = sorted(r for r in self.beams if self.running[r].decoding)
        t = min([tokens] + [len(self.running[r].seq) - self.running[r].written for r in group])
        keep = min(accepted, t)
        drafts_from = {rid: self.running[rid].written + keep for rid in group}
        with self.hot.allocator.forward(), self.cold.allocator.forward():
            self._write(lambda c: c.step(group, t), drafts_from)
            for rid in group:
                for c in (self.hot, self.cold):
                    c.rollback(rid, t - keep)
                self.running[rid].written += keep

    def _pairs(self):
        run = self.running
        return [(s, d) for s in sorted(self.beams) for d in sorted(self.beams)
                if s != d and run[s].written == run[d].written > 0 and len(run[s].seq) == len(run[d].seq)]

    @precondition(lambda self: bool(self._pairs()))
    @rule(data=st.data())
    def copy_contents(self, data):
        self._copy(data)

    @precondition(lambda self: bool(self._pairs()))
    @rule(data=st.data())
    def copy_contents_again(self, data):
        """Copies weigh twice as much as the other rules: beam search copies at every step."""
        self._copy(data)

    def _copy(self, data):
        """Beam search: a beam continues another's history (or two swap). Pairs whose pages in the
        prefix cache differ (their own pages shared as written, or a resumed prefix) are refused
        with nothing changed, as is (pages shared as written) a destination whose window holds a
        page of the cache."""
        src, dst = data.draw(st.sampled_from(self._pairs()))
        srcs, dsts = ([src, dst], [dst, src]) if data.draw(st.booleans()) else ([src], [dst])
        why = self._refusal(srcs, dsts)
        if why is not None:
            before = state(self.hot)
            with pytest.raises(RequestStateError, match=why):
                self.hot.copy_contents(srcs, dsts)
            assert state(self.hot) == before
            self.refused += 1
            return
        for c in (self.hot, self.cold):
            c.copy_contents(srcs, dsts)
        self.copies += 1
        took = [self.running[r] for r in srcs]
        rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
        for s, rid in zip(took, dsts):
            r = self.running[rid]
            held = max(s.written, s.prompt)   # its history is the source's, what follows its own
            new = _Req(np.concatenate((s.seq[:held], rng.integers(0, VOCAB, len(r.seq) - held))), s.prompt)
            new.written, new.admitted_with = s.written, getattr(r, "admitted_with", r.seq)
            self.running[rid] = new

    def _refusal(self, srcs, dsts):
        """What copy_contents must refuse (KVCache.copy_contents' contract), or None."""
        a = self.hot.allocator
        s, d = [a.slot_of[r] for r in srcs], [a.slot_of[r] for r in dsts]
        k = int(a.full_shared[s + d].max())
        if k and (np.any(a.full_shared[s + d] != k) or np.any(a.full_table[s, :k] != a.full_table[d, :k])):
            return "reading the same cached pages in each pair"
        if self.hot.prefix.share_as_written and any(
                np.any(a.swa.owner[a.window_swa_pages(x)] == CACHE_OWNER) for x in d):
            return "a destination's window holds a page of the prefix cache"
        return None

    # ---------------------------------------------------------------- finish three ways
    def _finish(self, rid):
        r = self.running[rid]
        self.runs.learn(r.seq)
        self.beams.discard(rid)
        way = self.steps % 3
        own = getattr(r, "admitted_with", None)
        if way == 0 and own is not None:   # the ids it was admitted with, though it holds another's content now
            ids = np.concatenate((own[:r.prompt], r.seq[r.prompt:r.written]))
            self.runs.learn(ids)
            before = state(self.hot)
            try:
                self.hot.finish(rid, token_ids=ids)
            except ContentMismatchError:
                assert state(self.hot) == before, "a refused finish changed the cache"
            else:
                self.running.pop(rid)
                self.cold.finish(rid)
                return
        if way == 1:   # without ids: only the prompt's pages are published
            self.running.pop(rid)
            self.hot.finish(rid)
            self.cold.finish(rid)
            if r.written > r.prompt:
                self.finished.append(r.seq[: r.written])
            return
        super()._finish(rid)

    # ---------------------------------------------------------------- another process on the store
    @precondition(lambda self: bool(self.finished))
    @rule(data=st.data())
    def restore_elsewhere(self, data):
        """Another cache on the same store prefetches a finished conversation (or a prefix of it)
        and admits it: what it restores is checked after the rule, with its own tree."""
        self.link.shared.flush(5.0)
        if self.reader is None:
            self.reader = allocate(self.hot.plan)
            self.reader_link = shared_link(self.reader, self.store)
        seq = self.finished[data.draw(st.integers(0, len(self.finished) - 1))]
        ids = seq[: data.draw(st.integers(1, len(seq)))]
        ready = self.reader_link.prefetch(len(ids), token_ids=ids)
        if ready is not None:
            ready.wait()
        if self.reader.can_admit(len(ids), 1, token_ids=ids):
            self.reader.admit("elsewhere", len(ids), 1, token_ids=ids)
            self.reader.finish("elsewhere")

    # ---------------------------------------------------------------- after every rule
    @invariant()
    def cached_bytes_are_a_cold_runs(self):
        for r in self.running.values():
            self.runs.learn(r.seq)
        self.runs.check(self.hot, "hot")
        if self.reader is not None:
            self.reader.check_integrity()
            self.reader_link.tier.check_integrity()
            self.runs.check(self.reader, "another process")

    def teardown(self):
        """The engine drains: every request still running finishes (each of the three ways, as
        it comes), and the caches are checked once more."""
        try:
            for rid in sorted(self.running):
                self._finish(rid)
                self.steps += 1
            self.books_and_reads()
            self.cached_bytes_are_a_cold_runs()
        finally:
            self._close()

    def _close(self):
        for cache in (self.hot, self.reader):
            if cache is not None:
                cache.close()


TestEveryCall = EveryCall.TestCase
TestEveryCall.settings = settings(max_examples=40 if SLOW else 3, stateful_step_count=40 if SLOW else 15,
                                  deadline=None, suppress_health_check=list(HealthCheck))


class EveryCallSharedAtFinish(EveryCall):
    """Pages shared when a request finishes (share_as_written off): beams of two prompts may copy
    each other's content, and what each may publish goes with it (issue 33's copy-then-finish)."""
    SHARE_AS_WRITTEN = False


TestEveryCallSharedAtFinish = EveryCallSharedAtFinish.TestCase
TestEveryCallSharedAtFinish.settings = TestEveryCall.settings

