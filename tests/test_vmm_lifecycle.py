"""VMM chunk bookkeeping under random lifecycles, through the KVCache interface, on CPU.

The driver is the in-memory STAND-IN (kvatlas.vmm.standin.StandInDriver), not CUDA: it poisons
a chunk when it is mapped and when it is unmapped, so a live page whose chunk was let go (or
mapped over) reads poison instead of the bytes written into it. Small chunks (64 KiB) make a
tiny plan span many of them.
"""

from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import kvatlas  # noqa: E402
from kvatlas import KvatlasError, PoolExhaustedError  # noqa: E402
from kvatlas.planning.buffers import FULL_PAGES, REQUEST_SLOTS, SWA_PAGES  # noqa: E402
from kvatlas.vmm import StandInDriver, VmmBackend  # noqa: E402
from lifecycle import apply_op, serve_shared_prompts, serve_turns  # noqa: E402

G = 64 << 10
OPTS = dict(chunked_prefill_tokens=300, draft_tokens=3)


def make_cache(model="tiny-v4", keep=2, cap=None, chunk=G, plan=None, **driver):
    p = kvatlas.budget_for(model, 4, 2048, **OPTS) if plan is None else plan
    backend = VmmBackend(StandInDriver(granularity=G, **driver), keep_empty_chunks=keep, max_physical_bytes=cap,
                         chunk_bytes=chunk)
    return kvatlas.allocate(p, backend=backend)


def chunkmap(cache):
    return cache.arena.backend.chunks


class Stamps:
    """Writes a value into every live unit the first time it is seen and checks it is still
    there after every operation. A unit is keyed by what it holds (request slot, logical page),
    so a page given back and handed out again in one call counts as new."""

    def __init__(self, cache) -> None:
        self.cache, self.seen = cache, {}
        a = cache.allocator
        # numpy views of the same memory: torch's CPU thread pool makes thousands of tiny ops slow
        self.bufs = {g: [r.tensor.view(torch.uint8).numpy() for r in cache.arena.regions.values()
                         if r.spec.group == g and r.spec.role != "table"] for g in (FULL_PAGES, SWA_PAGES, REQUEST_SLOTS)}
        self.ring = a.ring

    def live_keys(self):
        a = self.cache.allocator
        for s in sorted(a.slot_of.values()):
            yield (REQUEST_SLOTS, s, a.rid_of[s], s)
            for j in range(int(a.full_held[s])) if a.full is not None else ():
                yield (FULL_PAGES, s, j, int(a.full_table[s, j]))
            for j in range(int(a.swa_lo[s]), int(a.swa_hi[s])) if a.swa is not None else ():
                yield (SWA_PAGES, s, j, int(a.swa_table[s, j % self.ring]))

    def update_and_check(self) -> None:
        keys = set(self.live_keys())
        self.seen = {k: v for k, v in self.seen.items() if k in keys}
        for key, value in self.seen.items():
            for t in self.bufs[key[0]]:
                assert np.all(t[key[3]] == value), f"live unit {key} lost its data"
        for key in keys - set(self.seen):
            value = 1 + (hash(key) % 80)      # never a poison byte (0xA5, 0x5A)
            for t in self.bufs[key[0]]:
                t[key[3]] = value
            self.seen[key] = value


def check_backing(cache) -> None:
    cache.check_integrity()   # includes ChunkMap.problems(): refs recounted from the live units
    cm = chunkmap(cache)
    snap = cache.ledger.snapshot()
    assert snap.physical_bytes == cm.num_mapped * cm.G == cm.driver.mapped_bytes == int(cm.mapped.sum()) * cm.G
    assert np.all(cm.mapped[cm.refs > 0])                      # a live unit is always backed
    assert len(cm.retained) <= cm.keep


def apply(cache, op, x, running, next_id):
    """One lifecycle call chosen by (op, x); returns the new next_id. May raise."""
    if op == "admit":
        cache.admit(next_id, 1 + x % 700, x % 300)
        running.append(next_id)
        return next_id + 1
    if op == "trim":
        cache.arena.backend.trim()
        cm = chunkmap(cache)
        assert np.array_equal(cm.mapped, cm.refs > 0)           # nothing empty stays mapped
    else:
        apply_op(cache, op, x, running)
    return next_id


OPS = st.lists(st.tuples(st.sampled_from(["admit", "extend", "step", "step", "rollback", "finish", "flush", "trim"]),
                         st.integers(0, 10**6)), min_size=1, max_size=50)


@pytest.mark.parametrize("model", ["tiny-v4", "tiny-v4.1"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=OPS, keep=st.sampled_from([0, 1, 4]), chunk=st.sampled_from([G, 4 * G]))
def test_random_lifecycle_live_units_always_backed(model, script, keep, chunk):
    cache = make_cache(model, keep=keep, chunk=chunk)
    stamps = Stamps(cache)
    running, next_id = [], 0
    for op, x in script:
        try:
            next_id = apply(cache, op, x, running, next_id)
        except PoolExhaustedError as err:
            assert err.pool != "physical"       # no cap, no failing device here
            if op == "admit":
                next_id += 1
        check_backing(cache)
        stamps.update_and_check()
    for rid in running:
        cache.finish(rid)
    cache.arena.backend.trim()
    check_backing(cache)
    cm = chunkmap(cache)
    assert cm.num_mapped == len(cm.pinned) and cache.ledger.snapshot().occupied_bytes == 0


def replay(cache, log):
    """Apply every (op, x) of log, refusals included; return (running ids, next id)."""
    running, next_id = [], 0
    for op, x in log:
        try:
            next_id = apply(cache, op, x, running, next_id)
        except PoolExhaustedError:
            next_id += op == "admit"
    return running, next_id


def _twin(log, cap):
    """A cache with the same history (same cap, so the same refusals), then with the cap lifted."""
    twin = make_cache(cap=cap, keep=3)
    running, next_id = replay(twin, log)
    chunkmap(twin).max_chunks = None
    return twin, running, next_id


@settings(max_examples=20, deadline=None)
@given(script=OPS.map(lambda ops: ops[:30]), cap_chunks=st.integers(60, 140))
def test_max_physical_bytes_refuses_exactly(script, cap_chunks):
    """A call is refused for "physical" exactly when the chunks live after it would exceed the
    cap: a twin with the same history and no cap tells how many that would be."""
    cap = cap_chunks * G
    cache = make_cache(cap=cap, keep=3)
    log, running, next_id = [], [], 0
    for op, x in script:
        twin, twin_running, twin_next = _twin(log, cap)
        try:
            apply(twin, op, x, twin_running, twin_next)
            twin_error = None
        except KvatlasError as err:
            twin_error = err
        wanted = chunkmap(twin).num_live
        if op == "admit":
            assert cache.can_admit(1 + x % 700, x % 300) == (twin_error is None and wanted <= cap_chunks)
        log.append((op, x))
        try:
            next_id = apply(cache, op, x, running, next_id)
            assert twin_error is None and wanted <= cap_chunks
            assert chunkmap(cache).num_live == wanted
        except PoolExhaustedError as err:
            next_id += op == "admit"
            if err.pool == "physical":
                assert twin_error is None and wanted > cap_chunks
            else:
                assert isinstance(twin_error, PoolExhaustedError) and twin_error.pool == err.pool
        assert cache.ledger.snapshot().physical_bytes <= cap
        check_backing(cache)


def fingerprint(cache):
    a, cm, led = cache.allocator, chunkmap(cache), cache.ledger
    arrays = [a.length, a.full_held, a.reserved, a.swa_lo, a.swa_hi, a.full_table, a.swa_table, a.last_write]
    for fl in (a.slots, a.full, a.swa):
        if fl is not None:
            arrays += [fl.owner, fl.is_free]
    arrays += [cm.refs]
    return (tuple(x.tobytes() for x in arrays), a.outstanding, dict(a.slot_of), dict(led.entries_used),
            dict(led.units_used), led.running_requests, cm.num_live)


@settings(max_examples=30, deadline=None)
@given(script=OPS, fail_after=st.integers(0, 3), keep=st.sampled_from([0, 2]), prompt=st.integers(1, 700))
def test_failed_map_leaves_everything_as_it_was(script, fail_after, keep, prompt):
    cache = make_cache(keep=keep)
    running, next_id = replay(cache, script)
    driver, cm = cache.arena.backend.driver, chunkmap(cache)
    for attempt in (lambda: cache.admit("new", prompt), lambda: cache.extend("new", min(prompt, 300))):
        # a write first retires what the previous forward left out of the window (any next call
        # would); flushing now makes that happen before the fingerprint, so the refusal is alone
        cache.flush()
        before, mapped_before = fingerprint(cache), set(np.flatnonzero(cm.mapped).tolist())
        retained_before = set(cm.retained)
        driver.fail_after = fail_after
        try:
            attempt()
        except PoolExhaustedError as err:
            assert fingerprint(cache) == before
            if err.pool != "physical":
                return                          # full for another reason: nothing left to test
            assert "out of memory" in str(err)
            mapped_now = set(np.flatnonzero(cm.mapped).tolist())
            assert mapped_before - retained_before <= mapped_now <= mapped_before   # only the cache given back
            check_backing(cache)
            driver.fail_after = None
            attempt()                           # the same call succeeds once the device has memory
        driver.fail_after = None
        check_backing(cache)


def test_out_of_device_memory_gives_back_retained_chunks_first():
    cache = make_cache(keep=64)
    cm, driver = chunkmap(cache), cache.arena.backend.driver
    cache.admit("a", 1000)
    for _ in range(4):
        cache.extend("a", 250)
    cache.finish("a")
    assert len(cm.retained) > 0
    driver.capacity_bytes = driver.mapped_bytes        # the device is full: only the cache can make room
    cache.admit("b", 600)
    cache.extend("b", 300)
    check_backing(cache)
    assert driver.mapped_bytes <= driver.capacity_bytes
    driver.capacity_bytes = cm.num_live * G            # full of live data: the next map must be refused
    before = fingerprint(cache)
    with pytest.raises(PoolExhaustedError, match="out of memory"):
        cache.admit("c", 600)                          # its state rows need chunks of their own
    assert fingerprint(cache) == before and not cm.retained
    check_backing(cache)


def test_dense_placement_lets_chunks_empty_out():
    """Lowest-first placement: after the early requests finish, the late ones' pages move down
    as new pages are needed, so the high chunks empty and get unmapped."""
    cache = make_cache(keep=0)
    cm = chunkmap(cache)
    for r in range(4):
        cache.admit(r, 600)
        cache.extend(r, 300)
        cache.extend(r, 300)
    peak = cm.num_mapped
    for r in range(4):
        cache.finish(r)
    assert cm.num_mapped == len(cm.pinned) < peak
    cache.admit("x", 600)
    cache.extend("x", 300)
    a = cache.allocator
    assert a.full_table[a.slot_of["x"], :2].tolist() == [1, 2]     # lowest ids again
    check_backing(cache)


def test_prefix_cache_evicts_for_physical_memory():
    """Under max_physical_bytes the prefix cache's pages compete for chunks with what running
    requests write. A refusal for physical memory makes the cache evict (pages in its order, then
    resume points) and the units are asked for again. Before, the cache evicted only when a free
    list ran short, which a plan larger than the cap never does: here the 40th 1,024-token
    request was refused a prefill chunk with the cache full of pages nobody read, and every one
    after it. Each second request is the next turn of the one before (its prompt and 100
    tokens more): it resumes at the end of the pages it hits, the newest, which stay."""
    p = kvatlas.plan("tiny-v4", "256MiB", max_model_len=2048, max_running_requests=32, prefix_checkpoints=8,
                     chunked_prefill_tokens=256)
    cap = 40 << 20
    assert p.total_bytes > 2 * cap
    cache = make_cache(cap=cap, plan=p)
    cm = chunkmap(cache)

    def within_the_cap(_):
        assert cm.physical_bytes <= cap

    serve_turns(cache, 120, 1024, 100, 256, seed=5, after=within_the_cap)
    assert cache.prefix.stats.evicted_pages >= 40   # (65: the cap holds about 40 requests' pages)
    check_backing(cache)


def serve_capped(cache, cap, seed, on_admission, on_write_refused, seen=None) -> None:
    """serve_shared_prompts (1,200 steps) on a capped cache: the snapshot compared around each
    call is the prefix cache's eviction counters and idle pages (each appended to `seen`, if
    given); physical bytes within the cap after every step; the books recounted every 100 steps
    and at the end."""
    cm, pc = chunkmap(cache), cache.prefix
    seen = deque(maxlen=2) if seen is None else seen

    def evicted():
        s = pc.stats
        seen.append((s.evicted_pages, s.evicted_checkpoints, s.checkpoints_dropped, pc.tree.idle_pages))
        return seen[-1]

    def after_step(step):
        assert cm.physical_bytes <= cap
        if step % 100 == 0:
            check_backing(cache)

    serve_shared_prompts(cache, 1200, seed, evicted, on_admission, on_write_refused, after_step)
    check_backing(cache)


def test_prefix_cache_refusals_under_the_cap_evict_nothing():
    """Under a cap the running requests alone may pass, eviction cannot always make room: the
    cached pages may share every chunk with pages running requests write. Such a refusal must
    leave the cache as it was, and `can_admit` must foresee it. Before, the cache evicted what
    it held first and was refused anyway, and `can_admit` said yes while anything was evictable
    (this run on the old code: 131 admissions refused after a yes, 122 refused admissions and 49
    refused writes that had evicted units). Now nothing is evicted unless evicting everything
    evictable would make room (the chunks that empties, and the ids it frees in mapped chunks,
    which lowest-first placement hands out next: ChunkMap.fits_after). The books are recounted
    every 100 steps: they found a resume point evicted after its request finished freed twice
    (Tree.drop_checkpoint). Requests share six 512-token system prompts; a write refused for
    physical memory ends its request (an engine would preempt it)."""
    p = kvatlas.plan("tiny-v4", "256MiB", max_model_len=2048, max_running_requests=32, prefix_checkpoints=8,
                     chunked_prefill_tokens=256)
    cap = 16 << 20
    cache = make_cache(cap=cap, plan=p)
    pc = cache.prefix
    n = dict(admitted=0, refused=0, write_refusals=0)

    def admission(rid, yes, refusal, changed):
        if refusal is not None:
            assert refusal.pool == "physical" and not yes, f"{rid}: can_admit said yes, then the admission was refused"
            assert not changed, f"{rid}: a refused admission evicted units"
            n["refused"] += 1
        else:
            assert yes, f"{rid}: admitted where can_admit said no"
            n["admitted"] += 1

    def write_refused(rid, refusal, changed):
        assert refusal.pool == "physical" and not changed, f"{rid}: a refused write evicted units"
        n["write_refusals"] += 1

    serve_capped(cache, cap, 0, admission, write_refused)
    assert n["admitted"] > 300 and n["refused"] > 50 and n["write_refusals"] > 20   # (tight: all three happen)
    assert pc.stats.hit_tokens > 0 and pc.stats.evicted_pages > 0


def test_prefix_cache_short_of_pages_and_physical_memory_evicts_nothing():
    """A plan near its cap: an admission can be short of full pages (which eviction frees) and
    of physical memory for its slot's state rows (which eviction may not make) at once. It used
    to evict the pages first, then be refused for physical memory, after `can_admit` had said
    yes (this run on the old code: 11 such admissions). Now the slot's rows are asked first
    (`PrefixCache._slot_fits`): if no eviction would map them, nothing is evicted and the
    admission is refused; `can_admit` says no."""
    p = kvatlas.plan("tiny-v4", "92MiB", max_model_len=2048, max_running_requests=32, prefix_checkpoints=8,
                     chunked_prefill_tokens=256)
    assert p.num_full_pages == 48
    cap = 26 << 20
    cache = make_cache(cap=cap, plan=p)
    a = cache.allocator
    n = dict(admitted=0, short_pages=0, short_both=0, short_physical=0)
    seen = deque(maxlen=2)   # the snapshots before and after the last call

    def admission(rid, yes, refusal, changed):
        if refusal is None:
            assert yes, f"{rid}: admitted where can_admit said no"
            n["admitted"] += 1
            return
        assert not yes, f"{rid}: can_admit said yes, then the admission was refused ({refusal.pool})"
        assert not changed, f"{rid}: a refused admission evicted units"
        if refusal.pool == "full_pages":
            slot = a._slot_rows_shortfall()
            n["short_both" if slot is not None and slot.pool == "physical" else "short_pages"] += 1
        else:
            assert refusal.pool == "physical"
            n["short_physical"] += 1

    def write_refused(rid, refusal, changed):
        # (a refused write may still change the tree's idle count, or drop a resume point: the
        # pass's upkeep commits captures at its first write, whatever the write's fate; no page
        # goes for a physical need eviction cannot meet)
        assert refusal.pool == "physical" and seen[-1][0] == seen[-2][0], f"{rid}: a refused write evicted pages"

    serve_capped(cache, cap, 1, admission, write_refused, seen)
    assert n["admitted"] > 100 and n["short_both"] > 5 and n["short_pages"] > 20 and n["short_physical"] > 20, n
