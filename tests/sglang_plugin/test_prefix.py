"""SGLang's own allocator and radix cache (UnifiedRadixCache, its Rust tree core) on the CPU: the
plugin's evictable bytes equal the pages the radix cache holds that no request uses, and the SWA
prefix-tail quota gauge moves as tails are cached, with one warning line when the quota, not the
pool, bounds prefix hits."""

import logging
from array import array

import pytest
import torch

# bytes one page holds (V4-Flash, 43 layers: 21 C4, 20 C128; see test_live.py for the formats)
PER_FULL_PAGE = {"c4_kv": 21 * 64 * 583, "c128_kv": 20 * 2 * 583, "c4_indexer": 21 * 64 * 132,
                 "full_to_swa_index": 256 * 8}
PER_SWA_PAGE = {"swa_kv": 43 * 256 * 583, "c4_state": 21 * 8 * 2048 * 4, "c4_indexer_state": 21 * 8 * 512 * 4}
PAGE = 256


def _tree(pools):
    """The radix cache as SGLang's builder makes it for a DeepSeek-V4 pool (FULL + SWA components)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    return UnifiedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=pools.req_to_token_pool,
        token_to_kv_pool_allocator=pools.token_to_kv_pool_allocator, page_size=PAGE, sliding_window_size=128,
        chunked_prefill_size=8192, tree_components=(ComponentType.FULL, ComponentType.SWA)))


def _built(plugins_loaded, sglang_sequence, mode):
    from kvatlas.integrations.sglang import plugin as ks
    args, pools = sglang_sequence("deepseek-v4-flash", "4GiB", 32, mode)
    (ledger,) = [lg for lg in ks.ledgers() if lg.source is pools.token_to_kv_pool]
    return pools, _tree(pools), ledger


@pytest.fixture(scope="module")
def ratio(plugins_loaded, sglang_sequence):
    return _built(plugins_loaded, sglang_sequence, "ratio")


@pytest.fixture(scope="module")
def cap(plugins_loaded, sglang_sequence):
    return _built(plugins_loaded, sglang_sequence, "cap")


def cache(pools, tree, tokens: list[int]):
    """A finished request's prefix into the tree, as SGLang leaves it: full KV for every token, SWA
    for the last page only (the rest freed out of the window while it ran)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    alloc, n = pools.token_to_kv_pool_allocator, len(tokens)
    zero, length = torch.tensor([0]), torch.tensor([n])
    locs = alloc.alloc_extend(zero, zero, length, length, torch.tensor([-1]), n)
    kept = n - PAGE
    if kept:
        alloc.free_swa_segment(locs[:kept], start_pos=0)
    tree.insert(InsertParams(key=RadixKey(array("q", tokens)), value=locs,
                             component_evicted_seqlens={ComponentType.SWA: kept}))
    return locs


def _held_pages(alloc):
    """Pages SGLang's allocators do not have free: with no request running, what the tree holds."""
    return (alloc.size_full - alloc.full_available_size()) // PAGE, (alloc.size_swa - alloc.swa_available_size()) // PAGE


def _evictable(snap, pools):
    return {n: p.measures.evictable_bytes for n, p in snap.pools.items() if n in {**PER_FULL_PAGE, **PER_SWA_PAGE}}


def test_evictable_is_what_the_radix_cache_holds_unreferenced(ratio):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    pools, tree, ledger = ratio
    alloc = pools.token_to_kv_pool_allocator
    assert sum(_evictable(ledger.snapshot(), pools).values()) == 0
    a, b = [7] * 1024, [7] * 512 + [9] * 768          # b shares a's first two pages
    cache(pools, tree, a)
    cache(pools, tree, b)
    full, swa = _held_pages(alloc)
    assert (full, swa) == (4 + 3, 2)                 # a: 4 pages; b: 3 more; one SWA page each
    snap = ledger.snapshot()
    expect = {n: full * per for n, per in PER_FULL_PAGE.items()} | {n: swa * per for n, per in PER_SWA_PAGE.items()}
    assert _evictable(snap, pools) == expect
    for name in expect:                              # all of it is occupied too: cached, nobody reads it
        assert snap.pools[name].measures.occupied_bytes == expect[name]
    # a request matches b and holds it: its pages are occupied, no longer evictable
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", b))))
    lock = tree.inc_lock_ref(m.last_device_node)
    snap = ledger.snapshot()
    assert snap.pools["c4_kv"].measures.evictable_bytes == (full - 5) * PER_FULL_PAGE["c4_kv"]   # a's own 2 pages
    assert snap.pools["c4_kv"].measures.occupied_bytes == full * PER_FULL_PAGE["c4_kv"]
    assert snap.pools["swa_kv"].measures.evictable_bytes == (swa - 1) * PER_SWA_PAGE["swa_kv"]
    tree.dec_lock_ref(m.last_device_node, lock)
    tree.evict(EvictParams(num_tokens=full * PAGE, swa_num_tokens=swa * PAGE))
    assert _held_pages(alloc) == (0, 0)
    assert sum(_evictable(ledger.snapshot(), pools).values()) == 0


def test_tail_quota_moves_and_warns_once_when_it_bounds_hits(cap):
    from kvatlas.integrations.sglang import plugin as ks
    from kvatlas.integrations.foreign import samples
    pools, tree, ledger = cap
    pricing = ledger.prefix.pricing
    assert pricing.cap_mode and pricing.prefix_tails == 4 * 32 and pricing.tail_tokens == 128 + PAGE
    total = pricing.prefix_tails * pricing.tail_tokens

    def quota():
        rows = {lv[0]: v for n, ln, lv, v in samples(ledger.snapshot()) if n == "kvatlas_prefix_tail_quota_tokens"}
        return rows["used"], rows["total"]
    assert quota() == (0, total)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    ks.log.addHandler(handler)
    try:
        for i in range(total // PAGE):               # distinct two-page prefixes: one SWA page each
            cache(pools, tree, [100 + i] * 512)
            assert quota() == ((i + 1) * PAGE, total)
            ks.refresh()                             # SGLang's stats interval
    finally:
        ks.log.removeHandler(handler)
    warned = [line for line in lines if "prefix-tail quota" in line]
    assert len(warned) == 1 and f"{total:,}-token quota" in warned[0] and "--swa-prefix-tails" in warned[0]
    full_free = pools.token_to_kv_pool_allocator.full_available_size() / pools.token_to_kv_pool_allocator.size_full
    assert full_free > 0.5                           # the pool had room: the quota bounded the cache
