"""Prefix-cache granularity, eviction and accounting: hits in whole 256-token pages whatever the
C128/state geometry, multi-turn hits down to the last full page, hits with drafts on, misses
counted by reason, can_admit counting what eviction frees."""

import numpy as np
import pytest

from kvatlas import allocate, plan
from kvatlas.errors import ConfigError, KvatlasError
from kvatlas.prefix import page_keys


def cache(draft_tokens=0, policy="kvatlas", **kw):
    opts = dict(max_model_len=4096, max_running_requests=2, prefix_checkpoints=4, chunked_prefill_tokens=1024,
                draft_tokens=draft_tokens)
    opts.update(kw)
    return allocate(plan("tiny-v4", opts.pop("memory", "64MiB"), **opts), prefix_policy=policy)


def run(c, rid, ids, prompt, steps=0, tokens_each=1):
    adm = c.admit(rid, prompt, steps * tokens_each + 1, token_ids=ids[:prompt])
    done = adm.cached_tokens
    while done < prompt:
        n = min(1024, prompt - done)
        c.extend(rid, n)
        done += n
    for _ in range(steps):
        c.step([rid], tokens_each)
        c.flush()
    c.check_integrity()
    return adm


def test_keys_are_chained_per_full_page():
    ids = np.arange(700)
    k = page_keys(ids, 256)
    assert len(k) == 2                                   # the partial last page has no key
    other = ids.copy()
    other[3] = -5
    k2 = page_keys(other, 256)
    assert k2[0] != k[0] and k2[1] != k[1]               # a page's key covers every token before it
    assert np.array_equal(page_keys(ids[:512], 256), k)


def test_300_token_prompt_repeating_a_cached_page_hits_256():
    c = cache()
    ids = np.random.default_rng(0).integers(0, 1000, 300)
    run(c, "a", ids, 300)
    c.finish("a", token_ids=ids)
    adm = run(c, "b", ids, 300)
    assert adm.cached_tokens == 256
    s = c.prefix.stats
    assert s.hit_tokens == 256 and s.queried_tokens == 600
    assert s.missed_partial_page == 2 * 44 and s.missed_no_cached_prefix == 256


def test_multi_turn_hits_the_whole_previous_turn_down_to_the_last_full_page():
    c = cache()
    rng = np.random.default_rng(1)
    turn1 = rng.integers(0, 1000, 1000 + 37)             # prompt 1000, 37 generated
    run(c, "t1", turn1, 1000, steps=37)
    c.finish("t1", token_ids=turn1)
    turn2 = np.concatenate((turn1, rng.integers(0, 1000, 200)))
    adm = run(c, "t2", turn2, len(turn2))
    assert adm.cached_tokens == (1037 // 256) * 256 == 1024


@pytest.mark.parametrize("draft_tokens", [1, 3])
def test_hits_continue_with_drafts_on(draft_tokens):
    c = cache(draft_tokens=draft_tokens)
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 1000, 1000)
    c.admit("a", 600, 300, token_ids=ids[:600])
    c.extend("a", 600)
    for _ in range(200):                                 # each round: 1 token and rejected drafts
        c.step(["a"], 1 + draft_tokens)
        c.rollback("a", draft_tokens)
    c.check_integrity()
    c.finish("a", token_ids=ids[:800])
    adm = run(c, "b", ids, 900)
    assert adm.cached_tokens == 768


def test_third_request_sharing_a_system_prompt_hits_in_full():
    c = cache(policy="ends")   # a policy keeping intermediate points may let the second hit already
    rng = np.random.default_rng(3)
    system = rng.integers(0, 1000, 600)                  # 2 full pages + 88 tokens
    asks = [np.concatenate((system, rng.integers(0, 1000, 700))) for _ in range(3)]
    hits = []
    for i, ids in enumerate(asks):
        hits.append(run(c, f"q{i}", ids, len(ids)).cached_tokens)
        c.finish(f"q{i}", token_ids=ids)
    # the first leaves a resume point at its end (page 5), none at the divergence (page 2); the
    # second reveals the divergence point and saves it; the third resumes there
    assert hits == [0, 0, 512]
    assert c.prefix.stats.missed_no_checkpoint == 512


def test_eviction_makes_room_and_can_admit_counts_it():
    c = cache(max_model_len=2048, memory="24MiB")
    pages = c.plan.num_full_pages - 1
    rng = np.random.default_rng(4)
    n = 0
    while c.prefix.tree.idle_pages + 8 <= pages:         # fill the cache with finished requests
        ids = rng.integers(0, 1000, 2000)
        run(c, f"f{n}", ids, 2000)
        c.finish(f"f{n}", token_ids=ids)
        n += 1
    free = c.allocator.free_full_pages()
    assert free < 8                                      # a 2048-token request needs 8 new pages
    assert c.can_admit(2000, 48, token_ids=rng.integers(0, 1000, 2000))
    run(c, "big", rng.integers(0, 1000, 2048), 2000)
    assert c.prefix.stats.evicted_pages >= 8 - free
    snap = c.ledger.snapshot()
    assert 0 < snap.evictable_bytes <= snap.occupied_bytes <= snap.addressable_bytes


def test_evicted_pages_are_a_miss_reason():
    c = cache(max_model_len=2048, memory="24MiB")
    rng = np.random.default_rng(5)
    first = rng.integers(0, 1000, 2000)
    run(c, "a", first, 2000)
    c.finish("a", token_ids=first)
    for i in range(8):
        ids = rng.integers(0, 1000, 2000)
        run(c, f"x{i}", ids, 2000)
        c.finish(f"x{i}", token_ids=ids)
    before = c.prefix.stats.missed_evicted
    run(c, "again", first, 2000)
    assert c.prefix.stats.missed_evicted - before >= 256


def test_bad_prefix_input_is_a_clear_error():
    c = cache()
    with pytest.raises(KvatlasError, match="token_ids"):
        c.admit("a", 300, token_ids=np.arange(10))
    with pytest.raises(KvatlasError, match="page_keys"):
        c.admit("a", 300, page_keys=[1, 2, 3])
    c.check_integrity()
    with pytest.raises(ConfigError, match="swa_page_tokens"):
        plan("tiny-v4", "64MiB", prefix_checkpoints=2, swa_page_tokens=192)


def one_prompt(policy):
    """A 1800-token prompt run alone under `policy`: the cache afterwards."""
    c = allocate(plan("tiny-v4", "64MiB", max_model_len=4096, max_running_requests=2, prefix_checkpoints=16,
                      chunked_prefill_tokens=1024), prefix_policy=policy)
    ids = np.random.default_rng(6).integers(0, 1000, 1800)
    run(c, "a", ids, 1800)
    c.finish("a", token_ids=ids)
    return c


def test_policies_differ_only_in_what_they_keep():
    kept = {}
    for policy in ("ends", "every-page", "kvatlas"):
        c = one_prompt(policy)
        kept[policy] = c.prefix.tree.checkpoints
        spacing = c.prefix.policy.spacing_pages
    # boundaries at pages 1..7; the end (page 7) is always kept; kvatlas keeps every spacing-th
    assert spacing > 1   # fitted to the plan: 16 resume points cannot cover every page
    assert kept == {"ends": 1, "every-page": 7, "kvatlas": 1 + sum(1 for i in range(1, 7) if i % spacing == 0)}


def test_vllm_rules_as_named_policies():
    """vLLM's retention rules: junctions only (its interval 0) keeps the end alone here; periodic-N
    keeps a point every N tokens besides; a bad name is refused naming the field."""
    kept = {}
    for policy in ("junctions", "periodic-512", "periodic-1024"):
        c = one_prompt(policy)
        kept[policy] = sorted(n.depth for n in c.prefix.tree.nodes.values() if n.checkpoint is not None)
    assert kept == {"junctions": [7], "periodic-512": [2, 4, 6, 7], "periodic-1024": [4, 7]}
    for bad in ("periodic-", "periodic-x", "vllm"):
        with pytest.raises(ConfigError, match="prefix_policy"):
            cache(policy=bad)


def test_kvatlas_spacing_is_refitted_to_what_the_cache_holds():
    """After REFIT_FINISHES finishes the spacing follows the pages cached against the resume
    points the ends leave: one 7-page prompt asked again and again, room for a point at every
    page, so the next new prompt keeps all of its points."""
    from kvatlas.prefix.cache import REFIT_FINISHES
    c = allocate(plan("tiny-v4", "64MiB", max_model_len=4096, max_running_requests=2, prefix_checkpoints=16,
                      chunked_prefill_tokens=1024))
    assert c.prefix.policy.spacing_pages > 1   # the plan's fit: a cache full of pages
    ids = np.random.default_rng(8).integers(0, 1000, 1800)
    for i in range(REFIT_FINISHES):
        run(c, f"r{i}", ids, 1800)
        c.finish(f"r{i}")
    t = c.prefix.tree
    assert (len(t.nodes), t.marked) == (7, 1)
    assert c.prefix.policy.spacing_pages == 1 and c.prefix.policy.refit
    other = np.random.default_rng(9).integers(0, 1000, 1800)
    run(c, "new", other, 1800)
    c.finish("new", token_ids=other)
    path = t.match(page_keys(other, 256))
    assert len(path) == 7 and all(t.ckpt[n] is not None for n in path)   # every boundary, its end among them
