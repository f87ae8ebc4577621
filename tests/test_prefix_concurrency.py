"""The prefix cache under concurrency, as a stateful property test: many requests interleaved the
way an engine interleaves them — admissions with shared system prompts, follow-up turns and
fresh prompts, prefill chunks of several requests grouped in one forward pass, batched decode
steps with drafts and rollback, finishes while others prefill, eviction under memory pressure,
and (in the second machine) host-tier offload and prefetch. After every rule: every book against
a recount (KVCache.check_integrity: the tree, references, evictable units per group, the ledger's
chain evictable ≤ occupied ≤ addressable per pool), and every running request reads exactly what
its cold twin (a cache that never hits, fed the same tokens from scratch) reads. A rule evicts
everything evictable and checks that it frees exactly the evictable bytes, pool by pool.

Pages are shared as they are written (issue 34): followers admitted with the head of what a
running request has written so far (in prefill or decode, its decode pages given by `generated`)
read its pages while it goes on writing, drafting and rolling back, is cut short, has everything
evictable evicted (and, with the host tier, offloaded and brought back): still exactly what their
cold twins read. hypothesis is steered (`target`) toward runs with more such readers. A
follower may resume at the latest resume point of a writer still running (captured, not yet
kept or dropped: it is kept then), and requests that wait for a writer (`wait_for_writer`, a
scheduler's cache-aware admission) make the writer keep its point where their prompts leave its
pages, before they are admitted: every such point is checked like any other. Waiting requests
are enqueued with the cache (`enqueue`: eviction keeps what they will hit while anything else is
evictable), some leave the queue unadmitted (`dequeue`), and the queue's books are recounted
after every rule like the rest.

Before the issue 23 fix, two requests resumed from one point that retired a shared SWA page in
the same pass counted it evictable twice: this machine found it in a few dozen steps."""

import copy
import os

import numpy as np
from hypothesis import HealthCheck, reject, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvatlas import PoolExhaustedError, allocate, plan
from kvatlas.tiers import attach_host_tier
from kvatlas.vmm import StandInDriver, VmmBackend
from prefix_model import Model, assert_same_reads, prefix_hashes

SLOW = os.environ.get("KVATLAS_SLOW_TESTS") == "1"
REQUESTS, CHUNK, DRAFTS, MAX_LEN = 6, 512, 2, 2048
OPTIONS = dict(max_model_len=MAX_LEN, max_running_requests=REQUESTS, chunked_prefill_tokens=CHUNK,
               draft_tokens=DRAFTS, pp=2)   # stage 0 of tiny-v4: one SWA-only, one C4, one C128 layer
VOCAB = 5000


def st_int(data, most: int) -> int:
    return data.draw(st.integers(1, most))


class _Req:
    def __init__(self, seq, prompt):
        self.seq, self.prompt = np.asarray(seq, np.int64), prompt
        self.hashes = prefix_hashes(self.seq)
        self.written = 0

    @property
    def decoding(self) -> bool:
        return self.prompt <= self.written < len(self.seq)


class Concurrency(RuleBasedStateMachine):
    HOST = None   # bytes of host tier under the hot cache (None: device only)
    WARM = (0, 0, 1, 1)   # the system prompts run alone before the rules begin

    def __init__(self):
        super().__init__()
        # 48 full pages for 6 requests of up to 8: running requests and the cache compete
        self.hot = self._hot_cache(plan("tiny-v4", "32MiB", prefix_checkpoints=8, **OPTIONS))
        self.cold = allocate(plan("tiny-v4", "32MiB", **OPTIONS))   # never hits: the reference
        self.mh, self.mc = Model(self.hot), Model(self.cold)
        self.link = self._tiers()
        rng = np.random.default_rng(11)
        self.system = [rng.integers(0, VOCAB, n) for n in (300, 900)]
        self.finished: list = []
        self.running: dict = {}
        self.hit_pages: dict = {}   # per running request, the pages its admission hit
        self.read_running = 0       # admissions that read a page whose writer was still running
        self.waiting: list = []     # requests waiting, enqueued with the hot cache (wait_for_writer, enqueue)
        self.n = 0
        self.hits = 0
        self.steps = 0   # rules run so far: the rare rules (flush, cut short, evict all) key on it
        for i, system in enumerate(self.WARM):   # a warm cache: the second of each pair marks the
            self._alone(f"system{system}", 40 + i, 3, seed=i)   # divergence point, kept for the rest

    def _hot_cache(self, p):
        return allocate(p)

    def _tiers(self):
        """The tiers under the hot cache (a host or shared link, or None)."""
        return attach_host_tier(self.hot, self.HOST, checkpoint_share=0.5) if self.HOST else None

    def _alone(self, kind, extra, out, seed):
        """Admit one request and run it to its end by itself."""
        self.admit(kind, extra, out, seed)
        rid = f"r{self.n - 1}"
        r = self.running[rid]
        while r.written < r.prompt:
            n = min(CHUNK, r.prompt - r.written)
            self._write(lambda c: c.extend(rid, n))
            r.written += n
        while r.written < len(r.seq):
            self._write(lambda c: c.step([rid]))
            r.written += 1
        self._finish(rid)

    # ---------------------------------------------------------------- writes on both twins
    def _hashes(self, cache, w, drafts_from=None):
        """Per token of a write, its prefix hash; positions at or past drafts_from[rid] (rejected
        drafts) get hashes of other tokens, the same in both twins."""
        a = cache.allocator
        out = np.empty(w.num_tokens, np.int64)
        for i, (slot, pos) in enumerate(zip(w.request_slots.tolist(), w.positions.tolist())):
            rid = a.rid_of[slot]
            r = self.running[rid]
            bad = drafts_from is not None and pos >= drafts_from.get(rid, 1 << 60)
            out[i] = (int(r.hashes[pos]) * 7 + 3) % (1 << 61) if bad or pos >= len(r.seq) else r.hashes[pos]
        return out

    def _write(self, fn, drafts_from=None):
        for cache, model in ((self.hot, self.mh), (self.cold, self.mc)):
            w = fn(cache)
            model.write(w, self._hashes(cache, w, drafts_from))

    def _not_admitted(self, P, out, prompt):
        """can_admit said no (CappedConcurrency judges why)."""

    # ---------------------------------------------------------------- rules
    @precondition(lambda self: len(self.running) < REQUESTS)
    @rule(kind=st.sampled_from(["system0", "system0", "system1", "system1", "turn", "fresh"]), extra=st.integers(1, 500),
          out=st.integers(1, 200), seed=st.integers(0, 2**31))
    def admit(self, kind, extra, out, seed, head=None, rid=None):
        rng = np.random.default_rng(seed)
        if head is not None:
            pass
        elif kind == "turn" and self.finished:
            head = self.finished[seed % len(self.finished)]
        elif kind.startswith("system"):
            head = self.system[int(kind[-1])]
        else:
            head = rng.integers(0, VOCAB, 1)
        prompt = np.concatenate((head, rng.integers(0, VOCAB, extra)))[: MAX_LEN - out]
        seq = np.concatenate((prompt, rng.integers(0, VOCAB, out)))
        rid, P = f"r{self.n}" if rid is None else rid, len(prompt)
        self.n += 1
        if self.link is not None:
            ready = self.link.prefetch(P, token_ids=prompt)
            if ready is not None:
                ready.wait()
        ok = self.hot.can_admit(P, out, token_ids=prompt)
        if not ok:
            self._not_admitted(P, out, prompt)
            return
        shared = self._shared_as_written()
        adm = self.hot.admit(rid, P, out, token_ids=prompt)
        if shared.intersection(self.hot.prefix.requests[rid].path):
            self.read_running += 1   # it reads a page whose writer is still running
        self.cold.admit(rid, P, out)
        r = self.running[rid] = _Req(seq, P)
        self.hit_pages[rid] = adm.cached_tokens // 256
        self.hits += adm.cached_tokens > 0
        done = 0
        while done < adm.cached_tokens:   # the cold twin computes what the hot one took from the cache
            n = min(CHUNK, adm.cached_tokens - done)
            self.mc.write(w := self.cold.extend(rid, n), self._hashes(self.cold, w))
            done += n
        r.written = adm.cached_tokens

    @precondition(lambda self: len(self.running) < REQUESTS)
    @rule(system=st.integers(0, 1), extra=st.integers(1, 300), out=st.integers(1, 64), seed=st.integers(0, 2**31))
    def admit_shared(self, system, extra, out, seed):
        """Admissions weigh twice as much as the other rules, and most share a system prompt."""
        self.admit(f"system{system}", extra, out, seed)

    @precondition(lambda self: len(self.running) < REQUESTS - 1)
    @rule(system=st.integers(0, 1), extra=st.tuples(st.integers(1, 300), st.integers(1, 300)),
          seed=st.integers(0, 2**31))
    def admit_burst(self, system, extra, seed):
        """Two requests with one system prompt arrive together (they resume from one point and
        prefill side by side)."""
        for i, n in enumerate(extra):
            self.admit(f"system{system}", n, 1 + (seed + i) % 32, seed + i)

    @precondition(lambda self: len(self.running) < REQUESTS and any(r.written >= 256 for r in self.running.values()))
    @rule(data=st.data(), extra=st.integers(1, 300), out=st.integers(1, 64), seed=st.integers(0, 2**31))
    def admit_follower(self, data, extra, out, seed):
        """A request whose prompt begins with what a running request (in prefill or decode) has
        written so far, or part of it: it reads the pages that writer has shared as written."""
        writer = data.draw(st.sampled_from(sorted(rid for rid, r in self.running.items() if r.written >= 256)))
        w = self.running[writer]
        head = w.seq[: data.draw(st.integers(256, w.written))]
        self.admit("head", extra, out, seed, head=head)

    @precondition(lambda self: len(self.waiting) < 4 and any(r.written < r.prompt for r in self.running.values()))
    @rule(data=st.data(), extra=st.integers(1, 300), out=st.integers(1, 64), seed=st.integers(0, 2**31))
    def wait_for_writer(self, data, extra, out, seed):
        """A request whose prompt begins with more of a running request's prompt than it has
        written waits (a scheduler's cache-aware admission): asking which of its next pages
        running requests still write makes the writers keep their resume point where its prompt
        leaves theirs (admitted later by admit_waiting)."""
        writer = data.draw(st.sampled_from(sorted(rid for rid, r in self.running.items() if r.written < r.prompt)))
        w = self.running[writer]
        head = w.seq[: data.draw(st.integers(w.written + 1, w.prompt))]
        prompt = np.concatenate((head, np.random.default_rng(seed).integers(0, VOCAB, extra)))[: MAX_LEN - out]
        coming = self.hot.prefix.writing_next(len(prompt), token_ids=prompt)
        assert 0 <= coming <= (len(prompt) - 1) // 256
        self._enqueue(head, extra, out, seed)

    def _enqueue(self, head, extra, out, seed):
        rid = f"q{self.n}"
        self.n += 1
        prompt = np.concatenate((head, np.random.default_rng(seed).integers(0, VOCAB, extra)))[: MAX_LEN - out]
        self.hot.prefix.enqueue(rid, len(prompt), token_ids=prompt)
        self.waiting.append((head, extra, out, seed, rid))

    @precondition(lambda self: len(self.waiting) < 4)
    @rule(kind=st.sampled_from(["system0", "system1", "turn"]), extra=st.integers(1, 300), out=st.integers(1, 64),
          seed=st.integers(0, 2**31))
    def enqueue(self, kind, extra, out, seed):
        """A request joins the scheduler's queue: until it is admitted or leaves, eviction keeps
        the pages it would hit while others are evictable."""
        if kind == "turn" and self.finished:
            head = self.finished[seed % len(self.finished)]
        else:
            head = self.system[seed % 2]
        self._enqueue(head, extra, out, seed)

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data())
    def dequeue(self, data):
        """A waiting request leaves the queue unadmitted (cancelled)."""
        rid = self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1)))[4]
        assert self.hot.prefix.dequeue(rid) and not self.hot.prefix.dequeue(rid)

    @precondition(lambda self: bool(self.waiting) and len(self.running) < REQUESTS)
    @rule()
    def admit_waiting(self):
        head, extra, out, seed, rid = self.waiting.pop(0)
        self.admit("head", extra, out, seed, head=head, rid=rid)
        assert self.hot.prefix.dequeue(rid) == (rid not in self.running)   # admitted: dequeued by admit

    @precondition(lambda self: any(r.decoding for r in self.running.values()))
    @rule(data=st.data())
    def generated(self, data):
        """A decoding request gives its sequence so far: its full decode pages committed in passes
        that are over join the cache at the next pass's end, while it still runs."""
        rid = data.draw(st.sampled_from(sorted(rid for rid, r in self.running.items() if r.decoding)))
        r = self.running[rid]
        keyed = self.hot.generated(rid, r.seq[: r.written])
        assert keyed <= r.written // 256

    def _prefilling(self):
        return [rid for rid, r in self.running.items() if r.written < r.prompt]

    def _decoding(self):
        return [rid for rid, r in self.running.items() if r.decoding]

    @precondition(lambda self: any(r.written < r.prompt for r in self.running.values())
                  or any(r.decoding for r in self.running.values()))
    @rule(data=st.data())
    def forward_pass(self, data):
        """One forward pass: the decode batch (1 + drafts each, rejected ones rolled back) and
        prefill chunks of several requests within the token budget, grouped."""
        batch = self._decoding()
        budget = CHUNK
        each = {rid: data.draw(st.integers(1, min(1 + DRAFTS, len(self.running[rid].seq) - self.running[rid].written)))
                for rid in batch}
        budget -= sum(each.values())
        chunks = []
        for rid in self._prefilling():   # in admission order, as an engine's prefill queue
            r = self.running[rid]
            if budget <= 0:
                break
            left = min(budget, r.prompt - r.written)
            n = data.draw(st.sampled_from([left, left, st_int(data, left)]))   # mostly all the budget allows
            chunks.append((rid, n))
            budget -= n
        accepted = {rid: data.draw(st.integers(1, t)) for rid, t in each.items()}
        drafts_from = {rid: self.running[rid].written + accepted[rid] for rid in batch}
        with self.hot.allocator.forward(), self.cold.allocator.forward():
            if batch:
                tokens = np.array([each[rid] for rid in batch], np.int64)
                self._write(lambda c: c.step(batch, tokens), drafts_from)
                for rid in batch:
                    for c in (self.hot, self.cold):
                        c.rollback(rid, each[rid] - accepted[rid])
                    self.running[rid].written += accepted[rid]
            for rid, n in chunks:
                self._write(lambda c: c.extend(rid, n))
                self.running[rid].written += n

    @precondition(lambda self: any(r.written == len(r.seq) for r in self.running.values()))
    @rule(data=st.data())
    def finish(self, data):
        """Done generating, while others still prefill or decode."""
        self._finish(data.draw(st.sampled_from(sorted(r for r, q in self.running.items() if q.written == len(q.seq)))))

    @precondition(lambda self: bool(self.running) and self.steps % 8 == 7)
    @rule(data=st.data())
    def cut_short(self, data):
        """A request ends early (a stop token, a client gone), in prefill or decode."""
        self._finish(data.draw(st.sampled_from(sorted(self.running))))

    def _shared_as_written(self) -> set:
        """The tree's pages that running requests wrote and shared as written (past their hit)."""
        reqs = self.hot.prefix.requests
        return {n for rid in self.running for n in reqs[rid].path[self.hit_pages[rid]:]}

    def _finish(self, rid):
        r = self.running.pop(rid)
        del self.hit_pages[rid]
        self.hot.finish(rid, token_ids=r.seq[: r.written])
        self.cold.finish(rid)
        if r.written > r.prompt:
            self.finished.append(r.seq[: r.written])

    @precondition(lambda self: self.steps % 8 == 3)
    @rule()
    def flush(self):
        for c in (self.hot, self.cold):
            c.flush()

    @precondition(lambda self: self.steps % 16 == 13)
    @rule()
    def evict_everything(self):
        """Evicting every evictable page and resume point frees exactly the evictable bytes."""
        before = self.hot.ledger.snapshot()
        tree = self.hot.prefix.tree
        while tree.evict_checkpoint():
            pass
        tree.evict_pages(len(tree.nodes))
        after = self.hot.ledger.snapshot()
        for name, p in before.pools.items():
            freed = p.measures.occupied_bytes - after.pools[name].measures.occupied_bytes
            assert freed == p.measures.evictable_bytes, f"{name}: evicting everything freed {freed} B, " \
                                                        f"{p.measures.evictable_bytes} B were evictable"
            assert after.pools[name].measures.evictable_bytes == 0, name
        assert not tree.idle_pages and not tree.checkpoints
        assert self.hot.prefix.queued == len(self.waiting)

    # ---------------------------------------------------------------- after every rule
    @invariant()
    def books_and_reads(self):
        self.steps += 1
        self.hot.check_integrity()
        self.cold.check_integrity()
        if self.link is not None:
            self.link.tier.check_integrity()
        s = self.hot.prefix.stats
        assert s.queried_tokens == s.hit_tokens + sum(s.missed().values())
        rids = [rid for rid, r in self.running.items() if r.written]
        if rids:
            hot, cold = self.mh.reads_many(rids), self.mc.reads_many(rids)
            for rid in rids:
                assert_same_reads(hot[rid], cold[rid], rid)


    def teardown(self):
        target(float(self.read_running), label="admissions reading a running writer's pages")
        target(float(self.hot.prefix.stats.writer_points_read), label="admissions resuming at a running writer's point")


class HostConcurrency(Concurrency):
    HOST = "8MiB"


class CappedConcurrency(Concurrency):
    """The hot cache on the vmm backend (the stand-in driver, 64 KiB chunks: it poisons a chunk
    as it is mapped and as it is unmapped, so a live unit left without its chunk reads poison)
    with max_physical_bytes well below the plan, so what the cache keeps beside the running
    requests passes it. Before the fix, cached pages held every chunk the cap allowed and
    admissions and writes were refused with the cache full of pages nobody read; now the cache
    evicts for physical memory (`_need_physical`), which this machine counts and steers toward.
    Judged against brute force on a copy of the cache (every evictable unit evicted, then the
    call made again): `can_admit` says no exactly when no eviction makes room, an admission it
    said yes to is never refused, and a write is refused for physical memory only when eviction
    cannot make room (the running requests alone pass the cap: an engine preempts one), with
    nothing evicted for it (the cache used to be emptied first, for nothing); the example ends
    there."""

    CAP_BELOW_PLAN = 7 << 20

    def _hot_cache(self, p):
        backend = VmmBackend(StandInDriver(granularity=64 << 10), chunk_bytes=64 << 10, keep_empty_chunks=2,
                             max_physical_bytes=p.total_bytes - self.CAP_BELOW_PLAN)
        cache = allocate(p, backend=backend)
        self.physical_evictions = self.refusals_judged = 0
        evict = cache.allocator.on_need_physical

        def counted(tries, short=None):
            self.physical_evictions += 1
            return evict(tries, short)

        cache.allocator.on_need_physical = counted
        for name in ("admit", "extend", "step"):
            setattr(cache, name, self._refused_only_when_full(getattr(cache, name)))
        return cache

    def _evicted(self):
        s = self.hot.prefix.stats
        return s.evicted_pages, s.evicted_checkpoints, s.checkpoints_dropped

    def _still_refused(self, name, *args, **kwargs) -> bool:
        """On a copy of the hot cache: evict every unit eviction may take (for an admission, not
        its hit's pages nor the point it resumes at), then make the call again: whether it is
        refused for physical memory still."""
        twin = copy.deepcopy(self.hot)
        for attr in ("admit", "extend", "step"):   # the copy's own calls, not this machine's wrappers
            del twin.__dict__[attr]
        prefix, keep, hit = twin.prefix, None, []
        twin.allocator.on_need_physical = prefix._need_physical
        if name == "admit":
            m = prefix._match(args[1], kwargs["token_ids"], None)
            hit = m.path[:m.resume_pages]
            keep = prefix.tree.ckpt[hit[-1]] if hit and m.writer is None else None
        tree = prefix.tree
        tree.ref(hit, read=False)   # (held as the admission holds them)
        tries = 0
        while prefix._need_physical(tries, keep=keep):
            tries += 1
        tree.unref(hit, prefix.clock)
        try:
            getattr(twin, name)(*args, **kwargs)
        except PoolExhaustedError as exc:
            return exc.pool == "physical"
        return False

    def _not_admitted(self, P, out, prompt):
        """can_admit said no: if for physical memory, no eviction would have made room."""
        a = self.hot.allocator
        m = self.hot.prefix._match(P, prompt, None)
        short = a._admission_shortfall(a._validate_lengths(P, out), m.resume_pages)
        if short is not None and short.pool == "full_pages":   # (and its slot's rows, asked before evicting)
            short = a._slot_rows_shortfall()
        if short is not None and short.pool == "physical":
            self.refusals_judged += 1
            assert self._still_refused("admit", "probe", P, out, token_ids=prompt), \
                "can_admit said no where evicting would have made room"

    def _refused_only_when_full(self, call):
        def checked(*args, **kwargs):
            before = self._evicted()
            try:
                return call(*args, **kwargs)
            except PoolExhaustedError as exc:
                if exc.pool != "physical":
                    raise
                assert call.__name__ != "admit", "an admission can_admit said yes to was refused"
                assert self._evicted() == before, "a refusal for physical memory evicted units for nothing"
                self.refusals_judged += 1
                assert self._still_refused(call.__name__, *args, **kwargs), \
                    "refused for physical memory where evicting would have made room"
                self.hot.check_integrity()
                reject()
        return checked

    @invariant()
    def under_the_cap(self):
        chunks = self.hot.arena.backend.chunks
        assert chunks.physical_bytes <= chunks.max_chunks << chunks.shift

    def teardown(self):
        super().teardown()
        target(float(self.physical_evictions), label="evictions for physical memory")
        target(float(self.refusals_judged), label="refusals for physical memory judged")


_settings = settings(max_examples=40 if SLOW else 4, stateful_step_count=80 if SLOW else 40, deadline=None,
                     suppress_health_check=list(HealthCheck))
TestConcurrency = Concurrency.TestCase
TestConcurrency.settings = _settings
TestHostConcurrency = HostConcurrency.TestCase
TestHostConcurrency.settings = _settings
TestCappedConcurrency = CappedConcurrency.TestCase
# (examples where the running requests alone pass the cap are rejected, and hypothesis draws more
# for them: fewer and shorter here, the full count with KVATLAS_SLOW_TESTS=1)
TestCappedConcurrency.settings = settings(_settings, max_examples=40 if SLOW else 2,
                                          stateful_step_count=80 if SLOW else 30)
