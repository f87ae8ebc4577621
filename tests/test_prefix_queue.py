"""Queue-aware eviction (kvatlas.prefix.tree, module doc; PrefixCache.enqueue): the pages and
resume points that waiting requests would hit go only once nothing else is evictable, and then
the one whose first waiting reader is furthest back in the queue first; admit and dequeue take a
request's claims back; the simulator enqueues every arriving request."""

from __future__ import annotations

import numpy as np
import pytest
from tree_fakes import TreeAlloc

import kvatlas
from kvatlas import allocate, plan
from kvatlas.driving.sim import Simulator
from kvatlas.driving.workload import Request
from kvatlas.errors import ConfigError, KvatlasError, RequestStateError
from kvatlas.prefix.stats import PrefixStats
from kvatlas.prefix.tree import Tree




def _tree() -> Tree:
    return Tree(TreeAlloc(), None, PrefixStats(), reuse_weight=0.0)   # plain LRU underneath


def _await(t: Tree, order: int, *keys: int) -> None:
    """The `order`-th waiting request reads `keys`; each key's orders kept in queue order, as
    PrefixCache.enqueue keeps them (Tree.awaited)."""
    for k in keys:
        t.awaited[k] = dict.fromkeys(sorted({*t.awaited.get(k, {}), order}))


def test_an_awaited_page_outlives_later_pages_nobody_waits_for():
    t = _tree()
    for k in (1, 2, 3):
        t.add(k, None, 10 + k, now=k)      # LRU order: 1, 2, 3
    _await(t, 5, 1)
    assert t.evict_pages(2) == 2
    assert set(t.nodes) == {1} and t.alloc.freed == [12, 13]
    assert t.stats.evicted_awaited_pages == 0
    assert t.evict_pages(1) == 1 and not t.nodes   # nothing else left: it goes, counted
    assert t.stats.evicted_awaited_pages == 1 and t.stats.evicted_pages == 3


def test_among_awaited_pages_the_one_read_furthest_back_in_the_queue_goes_first():
    t = _tree()
    for k in (1, 2, 3):
        t.add(k, None, 10 + k, now=k)
    _await(t, 7, 1)          # page 1 (least recent) waits for the 7th request in the queue
    _await(t, 3, 2)          # page 2 for the 3rd
    _await(t, 9, 3)          # page 3 (most recent) for the 9th, the furthest back
    _await(t, 2, 3)          # ... and for the 2nd too: its first reader is the 2nd
    assert t.evict_pages(2) == 2
    assert t.alloc.freed == [11, 12]    # first readers 7, then 3; page 3's first reader (2) is next
    assert set(t.nodes) == {3} and t.stats.evicted_awaited_pages == 2


def test_a_parent_left_a_leaf_is_weighed_by_its_own_first_reader():
    t = _tree()
    root = t.add(1, None, 11, now=1)
    t.add(2, root, 12, now=2)
    t.add(3, None, 13, now=3)
    _await(t, 4, 1, 2)       # the 4th request reads page 1 then page 2
    _await(t, 6, 3)          # the 6th reads page 3
    assert t.evict_pages(2) == 2
    assert t.alloc.freed == [13, 12]    # page 3 (reader 6th) first, then the leaf 2; 1 stays
    assert set(t.nodes) == {1}
    _await(t, 8, 9)          # a key the tree does not hold changes nothing
    assert t.evict_pages(5) == 1 and not t.nodes


def test_pages_set_aside_stay_evictable_later():
    t = _tree()
    t.add(1, None, 11, now=1)
    t.add(2, None, 12, now=2)
    _await(t, 1, 1)
    assert t.evict_pages(1) == 1 and t.alloc.freed == [12]
    t.awaited.clear()        # its reader was admitted elsewhere: an ordinary LRU page again
    assert t.evict_pages(1) == 1 and t.alloc.freed == [12, 11] and t.stats.evicted_awaited_pages == 0


def _cache():
    return allocate(plan("tiny-v4", "24MiB", max_model_len=2048, max_running_requests=2, prefix_checkpoints=4,
                         chunked_prefill_tokens=1024))


def run_request(c, rid, ids, out=1, finished_with=None):
    """Admit, prefill in 1,024-token chunks, decode `out` tokens, finish (keyed by
    `finished_with`, else the prompt); the books checked. Returns the admission's hit."""
    adm = c.admit(rid, len(ids), out, token_ids=ids)
    done = adm.cached_tokens
    while done < len(ids):
        n = min(1024, len(ids) - done)
        c.extend(rid, n)
        done += n
    for _ in range(out):
        c.step([rid])
    c.finish(rid, token_ids=ids if finished_with is None else finished_with)
    c.check_integrity()
    return adm.cached_tokens


def _hit_after_cold_traffic(queue: bool) -> tuple[int, int]:
    """A prompt cached, a follower waiting for it, eight cold prompts through a cache that holds
    about three: (the follower's hit, its hit on a fresh cache right after the first)."""
    rng = np.random.default_rng(5)
    first = rng.integers(0, 1000, 2000)
    follower = np.concatenate((first, rng.integers(0, 1000, 40)))
    c = _cache()
    run_request(c, "a", first)
    if queue:
        c.prefix.enqueue("f", len(follower), token_ids=follower)
        assert c.prefix.queued == 1 and c.prefix.summary()["queued_requests"] == 1
    for i in range(8):
        run_request(c, f"x{i}", rng.integers(0, 1000, 2000))
    assert c.prefix.stats.evicted_pages >= 16
    got = run_request(c, "f", follower)
    assert c.prefix.queued == 0                        # admit dequeued it
    fresh = _cache()
    run_request(fresh, "a", first)
    return got, run_request(fresh, "f", follower)


def test_a_waiting_follower_still_hits_after_cold_traffic_and_misses_without_the_queue():
    got, fresh = _hit_after_cold_traffic(queue=True)
    assert got == fresh == 1792        # the 7 full pages of the 2000-token prompt, as with nothing between
    got, _ = _hit_after_cold_traffic(queue=False)
    assert got == 0


def test_dequeue_takes_the_claim_back_and_bad_calls_are_named():
    c = _cache()
    ids = np.arange(600) % 1000
    c.prefix.enqueue("w", 600, token_ids=ids)
    assert c.prefix.tree.awaited and len(c.prefix.tree.awaited) == 2   # (600 - 1) // 256 pages a hit may cover
    with pytest.raises(RequestStateError, match="request_id 'w' is queued already; admit or dequeue it first"):
        c.prefix.enqueue("w", 600, token_ids=ids)
    with pytest.raises(ConfigError, match=r"^prompt_tokens: 0 is out of range"):
        c.prefix.enqueue("v", 0, token_ids=ids)
    with pytest.raises(KvatlasError, match="token_ids: 600 ids for a 700-token prompt"):
        c.prefix.enqueue("v", 700, token_ids=ids)
    with pytest.raises(KvatlasError, match="page_keys: made for a 600-token prompt"):
        c.prefix.enqueue("v", 700, page_keys=c.prefix.prompt_keys(ids, 600))
    with pytest.raises(ConfigError, match="^request_id: None is not a request id"):
        c.prefix.enqueue(None, 600, token_ids=ids)
    assert c.prefix.queued == 1 and c.prefix.problems() == []
    c.admit("r", 600, 1, token_ids=ids)
    with pytest.raises(RequestStateError, match="request_id 'r' is running; a running request is not queued"):
        c.prefix.enqueue("r", 600, token_ids=ids)
    assert c.prefix.dequeue("w") and not c.prefix.dequeue("w") and not c.prefix.dequeue("never")
    assert c.prefix.tree.awaited == {} and c.prefix.queued == 0
    c.check_integrity()


def test_the_recount_finds_a_queue_book_that_disagrees():
    c = _cache()
    ids = np.arange(600) % 1000
    c.prefix.enqueue("w", 600, token_ids=ids)
    assert c.prefix.problems() == []
    k = next(iter(c.prefix.tree.awaited))
    c.prefix.tree.awaited[k][99] = None   # a claim no queued request makes
    assert any(p.startswith("prefix queue: 2 awaited keys") for p in c.prefix.problems()), c.prefix.problems()


def test_the_recount_finds_queue_orders_out_of_order():
    """Eviction reads a key's first waiting reader as its first entry: the recount checks the order."""
    c = _cache()
    ids = np.arange(600) % 1000
    c.prefix.enqueue("a", 600, token_ids=ids)
    c.prefix.enqueue("b", 600, token_ids=ids)
    assert c.prefix.problems() == []
    k = next(iter(c.prefix.tree.awaited))
    first, second = c.prefix.tree.awaited[k]
    c.prefix.tree.awaited[k] = {second: None, first: None}   # the same claims, the later reader first
    assert c.prefix.problems() == ["prefix queue: 1 awaited keys hold their queue orders out of order"]


def _sessions(n_cold: int) -> list[Request]:
    """One document read first, a burst of short cold prompts, then the document's follow-ups
    queued behind them."""
    def req(rid, t, prompt, blocks):
        return Request(id=rid, arrival_s=t, prompt_tokens=prompt, output_tokens=8, blocks=blocks)

    reqs = [req("doc", 0.0, 2000, (1, 2, 3, 4))]
    reqs += [req(f"cold{i}", 0.5, 600, (100 + 2 * i, 101 + 2 * i)) for i in range(n_cold)]
    reqs += [req(f"again{i}", 0.5, 2040, (1, 2, 3, 4, 50 + i)) for i in range(2)]
    return reqs


def _sim_hits(queue: bool) -> tuple[dict, int]:
    c = allocate(plan("tiny-v4", "24MiB", max_model_len=2048, max_running_requests=4, prefix_checkpoints=4,
                      chunked_prefill_tokens=1024))
    assert c.plan.num_full_pages == 33     # four running requests of three pages leave 21 to the cache
    sim = Simulator(c, _sessions(12), record=False, check_integrity=True, integrity_share=None,
                    queue_aware_eviction=queue)
    seen = []
    sim.run_offline(on_step=lambda s: seen.append(c.prefix.queued))
    return {t.id: t.cached_tokens for t in sim.latency.timings() if t.id.startswith("again")}, max(seen)


def test_the_simulator_enqueues_arrivals_and_the_followers_hit_behind_cold_traffic():
    hits, most = _sim_hits(queue=True)
    assert most == 12                     # the cold burst and the follow-ups waited, enqueued
    assert hits == {"again0": 1792, "again1": 1792}
    hits, most = _sim_hits(queue=False)
    assert most == 0 and hits["again0"] == 0


def test_the_simulator_refuses_a_queue_flag_that_is_not_a_bool():
    with pytest.raises(ConfigError, match="^queue_aware_eviction: 1 is not True or False; give a bool"):
        Simulator(_cache(), _sessions(1), queue_aware_eviction=1)
    no_prefix = kvatlas.allocate(plan("tiny-v4", "48MiB", max_model_len=2048, max_running_requests=2))
    assert not Simulator(no_prefix, _sessions(1)).queue_aware_eviction   # (nothing to tell: no prefix cache)


@pytest.mark.parametrize("flag", [[], ["--no-queue-aware-eviction"]])
def test_the_cli_flag_reaches_the_simulator_and_a_rejected_request_leaves_the_queue(tmp_path, flag):
    """simulate's --no-queue-aware-eviction turns it off; on (the default), a prompt longer than
    max_model_len is enqueued on arrival and dequeued when it is rejected: nothing is left queued."""
    from test_prefix_written import run_with_a_too_long_prompt
    cache, sim = run_with_a_too_long_prompt(tmp_path, "--check-integrity", *flag)
    queued = []
    sim.run_offline(on_step=lambda s: queued.append(cache.prefix.queued))
    assert sim.queue_aware_eviction == (not flag)
    assert sim.stats.rejected_too_long == 1 and sim.stats.finished == 2
    assert max(queued) == (0 if flag else 1) and cache.prefix.queued == 0 and cache.prefix.tree.awaited == {}


def test_metrics_and_state_report_the_queue_and_awaited_evictions():
    from kvatlas.observing.metrics import KvatlasCollector, exposition
    from kvatlas.observing.server import state_document
    c = _cache()
    rng = np.random.default_rng(7)
    first = rng.integers(0, 1000, 2000)
    run_request(c, "a", first)                               # 7 pages cached
    c.prefix.enqueue("w1", 2000, token_ids=first)
    c.prefix.enqueue("w2", 600, token_ids=first[:600])
    text = exposition(KvatlasCollector(c)).decode()
    assert "kvatlas_prefix_queued_requests 2.0" in text and "kvatlas_prefix_evicted_awaited_pages_total 0.0" in text
    for i in range(2):   # two cold requests at once, 8 pages each, 16 usable: all 7 awaited go (nothing else is idle)
        c.admit(f"cold{i}", 2000, 1, token_ids=rng.integers(0, 1000, 2000))
    s = c.prefix.stats
    assert s.evicted_awaited_pages == s.evicted_pages == 7
    c.check_integrity()
    text = exposition(KvatlasCollector(c)).decode()
    assert f"kvatlas_prefix_evicted_awaited_pages_total {float(s.evicted_awaited_pages)}" in text
    pc = state_document(KvatlasCollector(c))["caches"][0]["prefix_cache"]
    assert pc["queued_requests"] == 2 and pc["evicted_awaited_pages"] == s.evicted_awaited_pages
