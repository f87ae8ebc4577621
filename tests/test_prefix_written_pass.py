"""Pages shared as they are written (issue 34, the decode step's cost): a pass only notes that
it is over (a flag), and the pages complete at the lengths it committed join the tree before
anything reads or changes it (one vector comparison over the slots then: the length at which
each filling slot's next page is complete). The cache then holds, at every call, exactly what sharing each page at the end of its
pass leaves: tables, owners, references, the free lists and the chunks backing them, the ledger,
the tree (nodes, references, the order its eviction heaps pop in), the requests' paths and the
counts behind the miss reasons."""

import numpy as np
import pytest

from kvatlas import allocate, plan
from kvatlas.errors import KvatlasError, RequestStateError
from kvatlas.vmm import StandInDriver, VmmBackend

G = 64 << 10   # the stand-in's granularity: chunks small enough that frees change what is mapped
P = 256


def make_plan(checkpoints=16):
    # 33 full pages: four requests of 2,048 tokens, and the cache evicts soon; few checkpoints:
    # captures find no free unit and evict a resume point in the middle of a pass
    return plan("tiny-v4", "48MiB", max_model_len=2048, max_running_requests=4, prefix_checkpoints=checkpoints,
                chunked_prefill_tokens=P, draft_tokens=3, pp=2)


def make_cache(policy="every-page", backend="vmm", checkpoints=16):
    """backend vmm: lowest-first free lists over chunks mapped as used (a free may unmap one);
    plain: LIFO free lists, where the order pages are freed in is the order they come back."""
    if backend == "vmm":
        backend = VmmBackend(StandInDriver(granularity=G), chunk_bytes=G)
    return allocate(make_plan(checkpoints), backend=backend, prefix_policy=policy)


def free_state(fl):
    if hasattr(fl, "_stack"):
        return fl._stack[: fl.free].tolist()
    return fl._top, fl._holes.tolist(), [r.tolist() for r in fl._recent]


def alloc_state(cache) -> dict:
    a, led = cache.allocator, cache.ledger
    chunks = getattr(cache.arena.backend, "chunks", None)
    return {"full_table": a.full_table.tolist(), "full_shared": a.full_shared.tolist(),
            "full_held": a.full_held.tolist(), "full_refs": a.full_refs.tolist(), "owner": a.full.owner.tolist(),
            "free": free_state(a.full), "swa_owner": a.swa.owner.tolist(), "swa_free": free_state(a.swa),
            "swa_refs": a.swa_refs.tolist(), "ckpt_free": free_state(a.ckpt),
            "units": dict(led.units_used), "evictable": dict(led.units_evictable), "entries": dict(led.entries_used),
            "chunks": None if chunks is None else (chunks._refs.tolist(), chunks._live.tolist(),
                                                   list(chunks._retained), chunks.num_mapped)}


def cache_state(cache) -> dict:
    pc = cache.prefix
    t = pc.tree

    def ck(c):
        return None if c is None else (c.boundary_tokens, c.unit, c.end, c.divergence, c.last_used,
                                       int(t.key[c.node]) if c.node is not None else None)
    nodes = {k: (n.parent.key if n.parent else 0, n.depth, n.page, n.refs, n.children, n.last_used, n.reads,
                 n.checkpoint_evicted, ck(n.checkpoint)) for k, n in t.nodes.items()}
    # the heaps in the order they pop, without the push counter (the deferred cache pushes a
    # pass's pages later, after the captures of passes since; within each heap the order is
    # kept), the pages' heap without the entries eviction skips (node changed since: those of
    # pages shared in one go are pushed slot by slot, not pass by pass)
    live = [(e[0], e[2], int(t.key[e[3]])) for e in sorted(t._pages) if t._evictable(e)]
    return {**alloc_state(cache), "nodes": nodes, "heap": live,
            "lifetime": t.lifetime,
            "ckpt_heap": [(c, s, ck(x)) for c, s, _, x in sorted(t._ckpts)], "idle": t.idle_pages,
            "checkpoints": t.checkpoints, "marked": t.marked, "evicted_keys": list(t.evicted_keys),
            "requests": {r: ([int(t.key[n]) for n in q.path], q.keys.tolist(), [ck(c) for c in q.kept])
                         for r, q in pc.requests.items()},
            "coming": dict(pc._coming), "filling": sorted(pc._filling), "fill_due": pc._fill_due.tolist(),
            "hook": cache.allocator.on_pass_over is None, "stats": pc.stats.as_dict()}


def test_requests_admitted_past_the_cache_reach_boundaries():
    """Requests admitted on the allocator directly (past the prefix cache) capture resume points
    at their boundaries too; an upkeep whose captures are all theirs drops them all (it used to
    fail on the empty rest)."""
    cache = make_cache()
    a = cache.allocator
    a.admit("x", 1200, 8)
    for n in (P, P, P, P, 100):
        a.extend("x", n)
    a.flush()
    assert cache.prefix.stats.checkpoints_dropped > 0 and not cache.prefix.tree.nodes
    cache.check_integrity()
    a.finish("x")
    cache.check_integrity()


# ---------------------------------------------------------------- the prefix cache's pass
def share_at_pass_end(pc):
    """The model the deferred sharing is held to: every page shared as its pass ends."""
    note = pc._note_written

    def note_and_share():
        note()
        pc.alloc.commit_pass()
        pc._sync_written()
    pc._note_written = note_and_share   # (the hook a filling request sets is read from here)


class Twins:
    """The same calls on two caches, one sharing each pass's pages as the pass ends, the other
    deferring them; their whole state compared after each call (the deferred one's read through
    its `tree`, which shares what is noted first)."""

    def __init__(self, policy, backend, checkpoints=16):
        self.caches = [make_cache(policy, backend, checkpoints), make_cache(policy, backend, checkpoints)]
        share_at_pass_end(self.caches[0].prefix)
        self.shared = self.deferred = self.evicted_noted = 0
        a = self.caches[1].allocator
        need = a.on_need_checkpoint

        def counted():   # a capture evicting a resume point while pages wait to be shared
            self.evicted_noted += self.caches[1].prefix._noted
            return need()
        a.on_need_checkpoint = counted

    def __call__(self, fn, where, compare=True):
        """compare=False (passes only): the deferred cache keeps what its passes noted for the
        next call, which then must leave the same state."""
        self.deferred += self.caches[1].prefix._noted   # a call begins with pages noted, not shared yet
        out = []
        for c in self.caches:
            try:
                out.append(("ok", fn(c)))
            except RequestStateError as e:   # (copy_contents of requests it cannot pair)
                out.append(("refused", str(e)))
        assert out[0] == out[1], where
        if not compare:
            return out[0]
        states = [cache_state(c) for c in self.caches]
        assert states[0] == states[1], where
        for c in self.caches:
            c.check_integrity()
        self.shared = sum(len(q.path) for q in self.caches[1].prefix.requests.values())
        return out[0]


@pytest.mark.parametrize("seed,policy,backend,checkpoints", [
    (6, "every-page", "vmm", 16), (1, "kvatlas", "plain", 16), (2, "every-page", "plain", 16), (7, "kvatlas", "vmm", 16),
    (1, "kvatlas", "plain", 3), (2, "kvatlas", "vmm", 1)])
def test_deferred_sharing_leaves_what_sharing_at_each_pass_end_leaves(seed, policy, backend, checkpoints):
    """Requests with a shared system prompt, some admitted in pairs with the very same prompt and
    prefilling in the same passes (so one reads a page the other shared in that very pass),
    chunked prefill grouped into passes, decode steps with rejected drafts, their sequences given
    as they go (decode pages keyed), beam copies between requests of one length, finishes cutting
    them short, eviction: after every call both caches hold the same state, every book
    recounted. With few checkpoints a capture evicts a resume point in the middle of a pass,
    some while pages wait to be shared (the eviction does not share them first: no placed point
    depends on them)."""
    rng = np.random.default_rng(seed)
    look = np.random.default_rng(seed + 1000)   # after which passes the states are compared
    tw = Twins(policy, backend, checkpoints)
    system = rng.integers(0, 50_000, 600)
    running: dict = {}   # rid -> [sequence, prompt tokens, written]
    next_id = copy_tries = 0
    most_shared = 0
    for it in range(120):
        if len(running) < 4 and rng.random() < 0.5:
            prompt = np.concatenate((system, rng.integers(0, 50_000, int(rng.integers(50, 1200)))))
            for _ in range(1 + (rng.random() < 0.4)):   # (a pair: the same prompt, other continuations)
                seq = np.concatenate((prompt, rng.integers(0, 50_000, int(rng.integers(20, 150)))))
                rid = f"r{next_id}"
                next_id += 1
                _, got = tw(lambda c: c.can_admit(len(prompt), len(seq) - len(prompt), token_ids=prompt)
                            and c.admit(rid, len(prompt), len(seq) - len(prompt), token_ids=prompt).cached_tokens,
                            f"{it}: admit {rid}")
                if got is not False:
                    running[rid] = [seq, len(prompt), int(got)]
        prefilling = [r for r, (_, p_, w) in running.items() if w < p_]
        decoding = [r for r, (s_, p_, w) in running.items() if p_ <= w < len(s_) - 4]
        if prefilling and rng.random() < 0.7:   # a pass: a chunk of each request's prompt
            n = int(rng.integers(1, P + 1))
            chunk = {r: min(n, running[r][1] - running[r][2]) for r in prefilling}

            def prefill(c):
                with c.allocator.forward():
                    for r, k in chunk.items():
                        c.extend(r, k)
            tw(prefill, f"{it}: prefill {chunk}", compare=look.random() < 0.3)
            for r, k in chunk.items():
                running[r][2] += k
        elif decoding:
            tokens, accepted = int(rng.integers(1, 5)), 0
            accepted = int(rng.integers(1, tokens + 1))

            def step(c):
                c.step(decoding, tokens)
                for r in decoding:
                    c.rollback(r, tokens - accepted)
            tw(step, f"{it}: decode {decoding} {tokens}/{accepted}", compare=look.random() < 0.3)
            for r in decoding:
                running[r][2] += accepted
                if rng.random() < 0.5:
                    seq, _, w = running[r]
                    tw(lambda c: c.generated(r, seq[:w]), f"{it}: generated {r}")
            pairs = [(s_, d) for s_ in decoding for d in decoding if s_ != d and running[s_][2] == running[d][2]]
            if pairs and rng.random() < 0.5:
                src, dst = pairs[int(rng.integers(len(pairs)))]
                copy_tries += 1   # (refused where a kept point's window holds cache pages: both caches alike)
                if tw(lambda c: c.copy_contents([src], [dst]), f"{it}: copy {src} -> {dst}")[0] == "ok":
                    w = running[src][2]
                    running[dst][0] = np.concatenate((running[src][0][:w], running[dst][0][w:]))
                    running[dst][1] = running[src][1]
        else:
            tw(lambda c: c.flush(), f"{it}: flush")
        most_shared = max(most_shared, tw.shared)
        for r in list(running):
            seq, p_, w = running[r]
            if w >= len(seq) - 4 or rng.random() < 0.03:   # done, or cut short
                tw(lambda c: c.finish(r, token_ids=seq[:w]), f"{it}: finish {r}")
                del running[r]
    stats = tw.caches[1].prefix.stats
    assert most_shared > 0 and stats.hit_tokens > 0   # pages were shared while their writers ran, and read
    assert stats.evicted_pages > 0 and copy_tries > 0
    # calls that began with pages a pass had completed not shared yet (every-page: each page
    # completed has a resume point kept at its end, which shares it at once)
    assert tw.deferred >= (5 if policy == "kvatlas" else 0)
    if checkpoints < 16:
        assert tw.evicted_noted > 0


def test_a_scrape_reads_what_the_tree_holds_and_a_read_of_the_tree_shares_the_rest():
    """Pages a pass over completed wait, noted, for the tree's next reader: a metrics scrape or
    /state (which may run on another thread) reads without sharing them — they count as their
    writer's, as the ledger counts them — and the cache's `tree` (what its own calls, tiers and
    integrity checks read) shares them first, exact to the page."""
    from kvatlas.observing.metrics import KvatlasCollector
    cache = make_cache("ends", "plain")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50_000, 1500)
    cache.admit("w", len(prompt), 8, token_ids=prompt)
    for _ in range(4):   # four passes of a chunk each; each begins as the one before is over
        cache.extend("w", 200)
    pc, a = cache.prefix, cache.allocator
    assert pc._noted and not pc._tree.nodes and a.full_shared[a.slot_of["w"]] == 0

    def scraped():
        return {m.name: m.samples[0].value for m in KvatlasCollector(cache).collect()
                if m.name in ("kvatlas_prefix_cached_pages", "kvatlas_prefix_cached_bytes")}
    assert scraped() == {"kvatlas_prefix_cached_pages": 0, "kvatlas_prefix_cached_bytes": 0}
    assert pc.summary()["cached_pages"] == 0 and pc._noted   # read, nothing shared
    assert len(pc.tree.nodes) == 600 // P and not pc._noted   # the pages of the three passes over: 2
    assert a.full_shared[a.slot_of["w"]] == 2
    page = pc._unit_payload[0]
    assert scraped() == {"kvatlas_prefix_cached_pages": 2, "kvatlas_prefix_cached_bytes": 2 * page}
    cache.check_integrity()


def test_a_read_within_a_forward_group_shares_only_what_passes_over_completed():
    """Within a `forward()` group a request may be written more than once: a read of the tree
    in the middle of the group, or after it before the next pass begins, shares the pages
    complete when the group began, none that the group's own writes completed (their pass is
    not over), and those once it is. A request leaving its slot within the group leaves nothing
    committed there for the next."""
    cache = make_cache("ends", "plain")
    a, pc = cache.allocator, cache.prefix
    prompt = np.random.default_rng(3).integers(0, 50_000, 1500)
    cache.admit("w", len(prompt), 8, token_ids=prompt)
    slot = a.slot_of["w"]
    cache.extend("w", 200)
    cache.extend("w", 200)   # page 0 complete once this pass is over
    with a.forward():        # (which ends that pass)
        cache.extend("w", 150)   # page 1 complete (550 tokens): written in this group
        assert a.committed_lengths()[slot] == 400 == a.committed_lengths(slot)
        assert len(pc.tree.nodes) == 1 and a.full_shared[slot] == 1
        cache.extend("w", 50)    # (its last write no longer covers page 1)
        assert a.committed_lengths()[slot] == 400 and a.committed_lengths(np.array([slot])).tolist() == [400]
        assert len(pc.tree.nodes) == 1 and a.full_shared[slot] == 1
        with pytest.raises(KvatlasError, match="not its next complete, committed page"):
            a.share_written(slot, 1)
        with pytest.raises(KvatlasError, match="not the slots' next complete, committed pages"):
            a.share_written_runs(np.array([slot]), np.array([1]), np.array([2]))
        cache.check_integrity()
    assert a.committed_lengths()[slot] == 400   # (the group's pass is over when the next begins)
    assert len(pc.tree.nodes) == 1 and a.full_shared[slot] == 1
    cache.flush()
    assert a.committed_lengths()[slot] == 600
    assert len(pc.tree.nodes) == 2 and a.full_shared[slot] == 2
    cache.check_integrity()
    with a.forward():
        cache.extend("w", 200)   # page 2 complete (800 tokens), its pass not over
        assert len(pc.tree.nodes) == 2
        cache.finish("w")        # (a finish publishes what the request wrote)
        assert a.committed_lengths()[slot] == 0
    assert len(pc.tree.nodes) == 3
    cache.check_integrity()


def test_generated_within_a_forward_group_keys_only_committed_pages():
    """`generated` keys the pages past the prompt that passes over completed: within a
    `forward()` group that wrote the request twice, not the page its first write completed."""
    cache = make_cache("ends", "plain")
    a, pc = cache.allocator, cache.prefix
    seq = np.random.default_rng(4).integers(0, 50_000, 900)
    cache.admit("g", 100, 800, token_ids=seq[:100])
    cache.extend("g", 100)
    cache.extend("g", 200)   # page 0 complete (the prompt and 156 generated tokens)
    cache.flush()
    assert cache.generated("g", seq[:300]) == 1
    with a.forward():
        cache.extend("g", 250)   # page 1 complete (550 tokens) ...
        cache.extend("g", 50)    # ... and written again in the same pass
        assert a.committed_lengths(a.slot_of["g"]) == 300
        assert cache.generated("g", seq[:600]) == 1
        cache.check_integrity()
    cache.flush()
    assert cache.generated("g", seq[:600]) == 2
    cache.flush()   # (a page keyed by generated is shared as the next pass is over)
    assert len(pc.tree.nodes) == 2
    cache.check_integrity()


def test_committed_lengths_within_a_group_without_a_prefix_cache():
    """committed_lengths is the allocator's (public): without a prefix cache too, a group that
    writes a request twice leaves it at the length the group began at until its pass is over."""
    cache = allocate(plan("tiny-v4", "48MiB", max_model_len=2048, max_running_requests=4,
                          chunked_prefill_tokens=P), backend="none")
    a = cache.allocator
    assert not a.prefix_on
    cache.admit("x", 1000, 8)
    cache.extend("x", 200)
    with a.forward():
        cache.extend("x", 150)
        cache.extend("x", 50)
        assert a.committed_lengths(a.slot_of["x"]) == 200
    assert a.committed_lengths()[a.slot_of["x"]] == 200
    cache.flush()
    assert a.committed_lengths(a.slot_of["x"]) == 400
