"""Stateful property test: two rank processes' caches (bookkeeping: allocator, prefix cache, a
modeled host tier) over one store, many interleaved requests from a few conversations whose
turns land on either rank, with the store damaged, shrunk and switched off and on between them,
or up only from some step on (both ranks started before it: misses until it opens).
After every step: both allocators' integrity, both host tiers', no host slot claimed but by a
read still landing, and the tokens served by the shared tier within those served at all."""

import threading

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvatlas import plan
from kvatlas.alloc import Allocator
from kvatlas.alloc.integrity import check
from kvatlas.prefix import PrefixCache, page_keys
from kvatlas.tiers.modeled import ModeledHost
from kvatlas.tiers.shared import Breaker, OpeningStore, Store, StoreUnavailable, modeled_shared_link
from kvatlas.tiers.shared.memory_store import MemoryStore

P = plan("tiny-v4", "16MiB", max_model_len=2048, max_running_requests=2, prefix_checkpoints=4,
         chunked_prefill_tokens=512)


class Late(Store):
    """The shared store as a rank sees it when it started before the store was up: `open`
    fails until `up` is set (then this rank's OpeningStore opens it on its next attempt)."""

    name = "late"

    def __init__(self, store, up) -> None:
        self.store, self.up, self.ready = store, up, False

    def open(self, bound_s: float) -> None:
        if not self.up.is_set():
            raise StoreUnavailable("late: connection refused")
        self.ready = True

    def put_many(self, keys, values):
        return self.store.put_many(keys, values)

    def get_many(self, keys, dests):
        return self.store.get_many(keys, dests)

    def exists_many(self, keys):
        return self.store.exists_many(keys)

    def remove_many(self, keys):
        return self.store.remove_many(keys)


class Rank:
    def __init__(self, store, n: int) -> None:
        self.alloc = Allocator(P)
        self.prefix = PrefixCache(self.alloc)
        self.link = modeled_shared_link(self.prefix, ModeledHost(P, "4MiB", 0.5), store, scale=64, writer=n,
                                        breaker=Breaker(cooloff_s=0.0))
        self.n = 0

    def run(self, ids) -> int:
        keys = page_keys(ids, 256)
        self.link.prefetch(len(ids), page_keys=keys)
        rid = self.n = self.n + 1
        adm = self.prefix.admit(rid, len(ids), 4, page_keys=keys)
        done = adm.cached_tokens
        while done < len(ids) + 4:
            k = min(512, len(ids) + 4 - done)
            self.alloc.extend(rid, k)
            done += k
        self.prefix.finish(rid, token_ids=np.concatenate((ids, [1, 2, 3, 4])))
        self.link.shared.flush(5.0)
        return adm.cached_tokens


class SharedRanks(RuleBasedStateMachine):
    @initialize(cap=st.sampled_from([None, 6000, 20000]), late=st.booleans())
    def start(self, cap, late):
        """`late`: both ranks started before the store was up (each over an OpeningStore: misses
        until the rule `store_comes_up`)."""
        self.store = MemoryStore(cap)
        self.up = threading.Event()
        self.opening = [OpeningStore(Late(self.store, self.up), 1.0, retry_s=(0.005, 0.02)) for _ in range(2)] \
            if late else []
        self.ranks = [Rank(o, n) for n, o in enumerate(self.opening or [self.store] * 2, 1)]
        rng = np.random.default_rng(0)
        self.convs = [rng.integers(0, 50_000, 300) for _ in range(3)]
        self.shared_hits = 0

    @rule(rank=st.integers(0, 1), conv=st.integers(0, 2), extra=st.integers(1, 400), seed=st.integers(0, 99))
    def turn(self, rank, conv, extra, seed):
        ids = np.concatenate((self.convs[conv], np.random.default_rng(seed).integers(0, 50_000, extra)))[:1500]
        self.ranks[rank].run(ids)
        self.convs[conv] = ids

    @rule(pick=st.integers(0, 10_000), how=st.sampled_from(["truncate", "flip", "version"]))
    def damage(self, pick, how):
        keys = list(self.store.values)
        if not keys:
            return
        k = keys[pick % len(keys)]
        b = bytearray(self.store.raw_get(k))
        if how == "truncate":
            b = b[:-8]
        elif how == "flip":
            b[30] ^= 1
        else:
            b[4] ^= 3
        self.store.raw_put(k, bytes(b))

    @rule(down=st.booleans())
    def switch(self, down):
        self.store.down = down

    @rule()
    def store_comes_up(self):
        self.up.set()
        for o in self.opening:
            assert o.wait(10.0)

    @invariant()
    def not_open_means_no_store_call(self):
        for o, r in zip(self.opening, self.ranks):
            if not o.ready:
                snap = r.link.shared_snapshot()
                assert snap.hits == {"page": 0, "checkpoint": 0} and sum(snap.errors.values()) == 0
                assert all(v == 0 for k, v in snap.puts["page"].items() if k != "skipped")

    @invariant()
    def books_hold(self):
        for r in self.ranks:
            check(r.alloc)
            r.link.tier.check_integrity()
            held = sum(len(c.keys) for _, claims in r.link._quarantine for c in claims)
            assert sum(s.claimed for s in r.link.tier.slots.values()) == held
            snap = r.link.shared_snapshot()
            assert snap.hit_tokens <= r.prefix.stats.hit_tokens
            assert snap.hits["page"] <= snap.moved_entries["page"]["from_store"]


SharedRanks.TestCase.settings = settings(max_examples=12, stateful_step_count=30, deadline=None)
test_two_ranks_share_one_store = SharedRanks.TestCase


def test_a_turn_on_the_other_rank_hits_through_the_store():
    """What the machine above exercises: a conversation's next turn on the other rank."""
    store = MemoryStore()
    a, b = Rank(store, 1), Rank(store, 2)
    ids = np.random.default_rng(1).integers(0, 50_000, 700)
    assert a.run(ids) == 0
    follow = np.concatenate((ids, [1, 2, 3, 4], np.arange(300)))
    assert b.run(follow) == 512             # the 2 full pages of a's 704 tokens and its end point, from a
    snap = b.link.shared_snapshot()
    assert snap.hit_tokens == 512 and snap.hits == {"page": 2, "checkpoint": 1}
    store.down = True
    assert a.run(np.concatenate((follow, np.arange(50)))) > 0       # a's own device: the store is not needed
    assert b.run(np.random.default_rng(2).integers(0, 50_000, 600)) == 0
    assert b.link.shared_snapshot().misses["page"]["tier_unavailable"] >= 1
