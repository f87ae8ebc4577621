"""The host tier under the prefix cache, exact: the prefix cache's own exactness sessions (random
shared prefixes, multi-turn follow-ups, chunked prefill, drafts with rollback, eviction) run with
every eviction going to host memory and every admission first bringing back the host pages and
resume point its prompt reaches. Each request must still read, for every pool and layer, exactly
what its cold twin computed from scratch reads; integrity of both tiers after every operation."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import test_prefix_exact as exact
import kvatlas.prefix
from kvatlas import allocate, plan
from kvatlas.errors import KvatlasError
from kvatlas.tiers import attach_host_tier

HOST = "8MiB"


class HostSession(exact.Session):
    def __init__(self, p, device="cpu", impl="torch"):
        super().__init__(p, device, impl)
        self.link = attach_host_tier(self.hot, HOST, checkpoint_share=0.5)

    def admit(self, seq, prompt, max_new):
        ready = self.link.prefetch(prompt, token_ids=np.asarray(seq[:prompt], np.int64))
        if ready is not None:
            ready.wait()        # before the request's first forward pass
        super().admit(seq, prompt, max_new)

    def check(self, where):
        super().check(where)
        self.link.tier.check_integrity()


def run_conversations(seed, draft_tokens, turns=6, conversations=4, device="cpu", impl="torch"):
    """Multi-turn conversations that outgrow the device (16 full pages for 4 conversations of 4-6
    pages): each turn re-sends the previous turn and its answer plus new tokens, round robin, so
    the conversation coming back is the one evicted to host and returns as a host hit. Chunked
    prefill, drafts with rollback; hot and cold twins compared after every operation."""
    rng = np.random.default_rng(seed)
    s = HostSession(exact.make_plan(draft_tokens), device, impl)
    convs = [rng.integers(0, 50_000, int(rng.integers(1000, 1300))) for _ in range(conversations)]
    for i in range(turns):
        c = i % conversations    # round robin: the conversation coming back is the one evicted
        prompt = np.concatenate((convs[c], rng.integers(0, 50_000, int(rng.integers(100, 300)))))[:1500]
        max_new = int(rng.integers(1, 8))
        seq = np.concatenate((prompt, rng.integers(0, 50_000, max_new)))
        s.admit(seq, len(prompt), max_new)
        rid = f"r{s.next_id - 1}"
        if rid not in s.running:
            continue
        r = s.running[rid]
        while r.written < r.prompt:
            s.extend(rid, int(min(rng.integers(1, exact.CHUNK + 1), r.prompt - r.written)))
            s.check(f"turn {i} prefill")
        while r.written < len(r.seq):
            t = int(rng.integers(1, min(1 + s.draft, len(r.seq) - r.written) + 1))
            s.step(rid, t, int(rng.integers(1, t + 1)))
            s.check(f"turn {i} decode")
        s.finish(rid)
        convs[c] = seq
        s.check(f"turn {i} finish")
    return s


@pytest.mark.parametrize("draft_tokens", [0, 3])
@settings(max_examples=1, deadline=None, suppress_health_check=exact.SLOW)   # a session runs ~1 min on CPU
@given(seed=st.integers(0, 2**31))
def test_conversations_through_host_read_what_a_cold_run_reads(draft_tokens, seed):
    run_conversations(seed, draft_tokens)


def test_conversation_sessions_do_restore_from_host():
    """The sessions above exercise what they claim to (checked on a fixed seed)."""
    s = run_conversations(1, 3)
    snap = s.link.snapshot()
    assert snap.moved_to_host["pages"] > 0 and snap.hits["restored_pages"] > 0
    assert snap.hits["restored_checkpoints"] > 0 and s.hits > 0


@pytest.mark.gpu
def test_conversations_through_pinned_host_on_cuda_read_what_a_cold_run_reads():
    """The same sessions on the GPU: Triton data path, pinned host memory, the copy stream."""
    s = run_conversations(2, 3, turns=8, device="cuda", impl="auto")
    snap = s.link.snapshot()
    assert snap.pinned and snap.hits["restored_pages"] > 0


def run(data, draft_tokens):
    saved, exact.Session = exact.Session, HostSession
    try:
        return exact.run_session(data, draft_tokens)
    finally:
        exact.Session = saved


@pytest.mark.parametrize("draft_tokens", [0, 3])
@settings(max_examples=1, deadline=None, suppress_health_check=exact.SLOW)
@given(data=st.data())
def test_prefix_sessions_with_a_host_tier_read_what_a_cold_run_reads(draft_tokens, data):
    """The prefix cache's own random sessions, unchanged, with the host tier attached."""
    run(data, draft_tokens)


def _turns(link, cache, rng, n):
    """Multi-turn conversations that outgrow the device: each turn re-sends the last one."""
    convs = [rng.integers(0, 50_000, 300) for _ in range(6)]
    for i in range(n):
        c = i % 6
        convs[c] = np.concatenate((convs[c], rng.integers(0, 50_000, 200)))
        seq = convs[c][:1500]
        ready = link.prefetch(len(seq), token_ids=seq)
        if ready is not None:
            ready.wait()
        cache.admit(f"r{i}", len(seq), 8, token_ids=seq)
        left = len(seq) - int(cache.allocator.length[cache.allocator.slot_of[f"r{i}"]])
        while left:
            cache.extend(f"r{i}", min(left, 512))
            left -= min(left, 512)
        for _ in range(8):
            cache.step([f"r{i}"], 1)
        cache.finish(f"r{i}", token_ids=np.concatenate((seq, rng.integers(0, 50_000, 8))))
        cache.check_integrity()
        link.tier.check_integrity()


def test_evictions_go_to_host_and_come_back_as_hits():
    p = plan("tiny-v4", "64MiB", max_model_len=2048, max_running_requests=2, prefix_checkpoints=2,
             chunked_prefill_tokens=512)
    cache = allocate(p)
    link = attach_host_tier(cache, HOST, checkpoint_share=0.5)
    _turns(link, cache, np.random.default_rng(0), 24)
    snap = link.snapshot()
    assert snap.moved_to_host["pages"] > 0 and snap.moved_to_device["pages"] > 0
    assert snap.hits["host_hit_tokens"] > 0 and snap.hits["restored_checkpoints"] > 0
    assert cache.prefix.stats.hit_tokens >= snap.hits["host_hit_tokens"]
    # /state and /metrics show both tiers, each in its own section / families
    from kvatlas.observing.metrics import KvatlasCollector, exposition
    from kvatlas.observing.server import state_document
    col = KvatlasCollector(cache)
    doc = state_document(col)["caches"][0]
    assert doc["host_tier"]["host_totals"]["planned"] == link.tier.plan.total_bytes
    assert doc["ledger"]["totals"]["planned"] == p.total_bytes
    text = exposition(col).decode()
    assert 'kvatlas_prefix_tier_hit_tokens_total{tier="host"}' in text
    assert "kvatlas_host_tier_restore_seconds_count" in text
    cache.close()


def test_a_plan_without_prefix_cache_is_refused():
    cache = allocate(plan("tiny-v4", "64MiB", max_running_requests=2))
    with pytest.raises(KvatlasError, match="prefix_checkpoints"):
        attach_host_tier(cache, HOST)


def test_prefetch_into_a_device_with_no_room_brings_back_nothing_yet():
    """Every page held by running requests: a prefetch finds no room for the host pages a prompt
    reaches. It brings back nothing and changes nothing (it raised PoolExhaustedError out of the
    admission path before); once the pages are free it brings them back and the prompt hits."""
    p = plan("tiny-v4", "64MiB", max_model_len=2048, max_running_requests=2, prefix_checkpoints=2,
             chunked_prefill_tokens=512)
    cache = allocate(p)
    link = attach_host_tier(cache, HOST, checkpoint_share=0.5)
    rng = np.random.default_rng(0)
    first = rng.integers(0, 50_000, 1000)
    for i, seq in enumerate([first] + [rng.integers(0, 50_000, 1500) for _ in range(4)]):   # first goes to host
        cache.admit(f"r{i}", len(seq), 4, token_ids=seq)
        for n in range(0, len(seq), 512):
            cache.extend(f"r{i}", min(512, len(seq) - n))
        cache.finish(f"r{i}", token_ids=seq)
    assert link.tier.contains("page", int(kvatlas.prefix.page_keys(first, 256)[0]))
    for rid in ("big", "big2"):   # two requests reserve every full page; nothing cached is left to evict
        cache.admit(rid, 10, 2030, token_ids=rng.integers(0, 50_000, 10))
    assert cache.allocator.free_full_pages() == 0 and cache.prefix.tree.idle_pages == 0
    before = link.snapshot()
    assert link.prefetch(len(first), token_ids=first) is None
    assert link.snapshot().groups == before.groups and link.snapshot().hits == before.hits
    cache.check_integrity()
    link.tier.check_integrity()
    for rid in ("big", "big2"):
        cache.finish(rid)
    ready = link.prefetch(len(first), token_ids=first)
    assert ready is not None
    ready.wait()
    assert cache.admit("again", len(first), 4, token_ids=first).cached_tokens == 768
    cache.check_integrity()
    link.tier.check_integrity()


def _tier_counters(col) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    from kvatlas.observing.metrics import exposition
    out = {}
    for fam in text_string_to_metric_families(exposition(col).decode()):
        if fam.name == "kvatlas_prefix_tier_hit_tokens":
            out.update({s.labels["tier"]: s.value for s in fam.samples if s.name.endswith("_total")})
    return out


def test_tier_hit_counters_never_go_down_across_a_host_prefetch():
    """Issue 33: the device tier's hits were served - host - shared, host hits counted at the
    prefetch and served tokens at the admission, so between the two the device counter dropped
    (Prometheus reads that as a reset). Each tier now counts where the hit is decided, the
    admission: scraped after every step, no counter ever decreases, and they add up to the hits."""
    from kvatlas.observing.metrics import KvatlasCollector
    p = plan("tiny-v4", "64MiB", max_model_len=2048, max_running_requests=2, prefix_checkpoints=2,
             chunked_prefill_tokens=512)
    cache = allocate(p)
    link = attach_host_tier(cache, HOST, checkpoint_share=0.5)
    col, seen = KvatlasCollector(cache), []
    rng = np.random.default_rng(3)
    convs = [rng.integers(0, 50_000, 600) for _ in range(2)]

    def scrape(where):
        now = _tier_counters(col)
        if seen:
            for tier, v in seen[-1][1].items():
                assert now[tier] >= v, f"{where}: {tier} hits went from {v} to {now[tier]}"
        assert sum(now.values()) == cache.prefix.stats.hit_tokens, where
        seen.append((where, now))

    for i in range(10):   # two conversations in turns; the device holds few pages, so turns come from host
        c = i % 2
        convs[c] = np.concatenate((convs[c], rng.integers(0, 50_000, 150)))[:1500]
        seq, rid = convs[c], f"r{i}"
        ready = link.prefetch(len(seq), token_ids=seq)
        scrape(f"turn {i} prefetched")
        if ready is not None:
            ready.wait()
        if i == 4:   # a device-only hit between a prefetch and its admission
            other = cache.admit("d", len(convs[1 - c]), 1, token_ids=convs[1 - c])
            scrape(f"turn {i} other admitted ({other.cached_tokens} cached)")
            cache.finish("d")
        cache.admit(rid, len(seq), 4, token_ids=seq)
        scrape(f"turn {i} admitted")
        left = len(seq) - int(cache.allocator.length[cache.allocator.slot_of[rid]])
        while left:
            cache.extend(rid, min(left, 512))
            left -= min(left, 512)
        cache.finish(rid, token_ids=seq)
        scrape(f"turn {i} finished")
        if i % 3 == 2:   # everything evictable goes to host
            while cache.prefix.tree.evict_checkpoint():
                pass
            cache.prefix.tree.evict_pages(len(cache.prefix.tree.nodes))
            scrape(f"turn {i} evicted")
    last = seen[-1][1]
    assert last["host"] > 0 and last["device"] > 0, last
    assert link.snapshot().hits["host_hit_tokens"] == last["host"]
    cache.close()
