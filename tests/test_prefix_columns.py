"""The page tree as columns (kvatlas.prefix.tree, module doc): a node is its full page's number,
its fields arrays indexed by it. An id comes back when its page is evicted and taken again, so
a heap entry of the page's earlier node must never count for the new one; eviction puts every
field back to 0, so a new node writes only what differs; and the integrity recount checks what
the columns hold, the running requests' paths among it."""

import numpy as np
import pytest
from tree_fakes import TreeAlloc

from kvatlas import allocate, plan
from kvatlas.prefix import page_keys
from kvatlas.prefix.stats import PrefixStats
from kvatlas.prefix.tree import Checkpoint, NodeView, Tree

P = 256




def test_an_entry_of_a_page_evicted_and_taken_again_is_stale():
    t = Tree(TreeAlloc(), None, PrefixStats(), reuse_weight=0.0)
    t.add(100, None, 5, now=1)
    old = t._pages[0]
    assert t._evictable(old)
    assert t.evict_pages(1) == 1 and t.alloc.freed == [5]
    again = t.add(200, None, 5, now=1)   # the same page, the same last use and due: only the generation differs
    assert again == 5 and t.index == {200: 5}
    assert not t._evictable(old) and t._evictable(t._pages[-1])
    assert t.nodes[200] == NodeView(t, 5) and t.nodes[200].key == 200 and t.nodes[200].parent is None


def test_eviction_leaves_every_field_as_a_page_no_node_holds():
    t = Tree(TreeAlloc(), None, PrefixStats(), reuse_weight=0.5)
    t.lifetime = 10.0
    a = t.add(1, None, 3, now=1)
    b = t.add(2, a, 4, now=2)
    t.ref([a, b])
    t.unref([a, b], 7)
    assert (int(t.depth[b]), int(t.parent[b]), int(t.children[a]), int(t.reads[b])) == (2, 3, 1, 1)
    assert t.evict_pages(2) == 2 and t.alloc.freed == [4, 3]   # the leaf first, then its parent
    for name in ("key", "parent", "depth", "refs", "children", "last_used", "reads", "due", "ck_evicted"):
        col = getattr(t, name)
        assert col[3] == col[4] == (-1 if name == "parent" else 0), name
    assert t.index == {} and t.idle_pages == 0


def test_pageless_nodes_take_ids_past_the_pool_and_give_them_back():
    alloc = TreeAlloc()
    alloc.full = None
    t = Tree(alloc, None, PrefixStats(), reuse_weight=0.0)
    a = t.add(1, None, -1, now=1)
    b = t.add(2, a, -1, now=2)
    assert (a, b) == (0, 1) and t.page_of(a) == -1 and list(t.pages_of([a, b])) == [-1, -1]
    assert t.evict_pages(1) == 0 and len(t.index) == 2   # no page to free: nothing is taken for it
    t.prune(b)   # (no reader, no node below, no resume point: b goes, then a)
    assert t.index == {} and alloc.freed == [] and t._pages == []
    assert sorted([t.add(3, None, -1, now=3), t.add(4, None, -1, now=3)]) == [0, 1]   # their ids again
    assert t.add(5, None, -1, now=3) == 2


def _writing_cache():
    """One request in prefill sharing its pages as it writes them, one reading them."""
    p = plan("tiny-v4", "48MiB", max_model_len=2048, max_running_requests=4, prefix_checkpoints=16,
             chunked_prefill_tokens=P)
    c = allocate(p, backend="none", prefix_policy="every-page")
    ids = np.arange(1500) % 991
    c.admit("w", 1500, 4, token_ids=ids)
    for _ in range(4):
        c.extend("w", P)
        c.step(["w"])
    c.admit("r", 1200, 4, token_ids=ids[:1200])
    assert c.prefix.problems() == [] and len(c.prefix.requests["w"].path) == 4
    return c


@pytest.mark.parametrize("damage, says", [
    (lambda t, pc: t.children.__setitem__(pc.requests["w"].path[0], 3), "child count"),
    (lambda t, pc: t.depth.__setitem__(pc.requests["w"].path[1], 9), "depth"),
    (lambda t, pc: t.reads.__setitem__(t._size - 1, 1), "reads is set on an id no node holds"),
    (lambda t, pc: t.parent.__setitem__(pc.requests["w"].path[2], pc.requests["w"].path[0]), "chain"),
    (lambda t, pc: pc.requests["w"].path.reverse(), "chain"),
    (lambda t, pc: t.key.__setitem__(pc.requests["w"].path[3], 7), "key index"),
    (lambda t, pc: pc._paths.__setitem__(pc.alloc.slot_of["w"], list(pc.requests["w"].path)), "path is not"),
    (lambda t, pc: pc._unplaced.add(pc.alloc.slot_of["r"]), "not filling"),   # ("r" has no page to share)
    (lambda t, pc: t.ckpt.__setitem__(t._size - 1, Checkpoint(P, 1, np.zeros(0, np.int64))), "resume point or origin is set on an id"),
    (lambda t, pc: t.origin.__setitem__(t._size - 1, "host"), "resume point or origin is set on an id"),
])
def test_the_recount_finds_damaged_columns(damage, says):
    c = _writing_cache()
    pc = c.prefix
    damage(pc.tree, pc)
    problems = pc.problems()
    assert any(says in p for p in problems), problems


def test_a_path_on_pages_its_table_does_not_list_is_found():
    c = _writing_cache()
    pc, a = c.prefix, c.allocator
    slot = a.slot_of["r"]
    a.full_table[slot, 0], a.full_table[slot, 1] = a.full_table[slot, 1], a.full_table[slot, 0]
    assert any("block table does not list" in p for p in pc.problems())


def test_the_key_matrix_grows_with_the_longest_keyed_request_and_keeps_what_others_wait_to_share():
    """The per-slot key matrix has the columns the longest keyed request so far needs, not the
    block table's: a long prompt admitted while a short one still has pages to share grows it,
    and the short one's keys come through (the recount compares the matrix with every filling
    request's keys after every pass)."""
    p = plan("tiny-v4", "96MiB", max_model_len=4096, max_running_requests=4, prefix_checkpoints=16,
             chunked_prefill_tokens=P)
    c = allocate(p, backend="none", prefix_policy="every-page")
    pc = c.prefix
    assert pc._slot_keys.shape[1] == 8 < c.allocator.full_table.shape[1] == 16
    rng = np.random.default_rng(3)
    short, long = rng.integers(0, 50_000, 2000), rng.integers(0, 50_000, 3900)
    c.admit("short", 2000, 4, token_ids=short)
    c.extend("short", P)
    c.admit("long", 3900, 4, token_ids=long)   # 15 keyed pages: the matrix grows under "short"
    assert pc._slot_keys.shape[1] == 16
    left = {"short": 2000 - P, "long": 3900}
    while any(left.values()):
        with c.allocator.forward():
            for rid in [r for r, n in left.items() if n]:
                k = min(P, left[rid])
                c.extend(rid, k)
                left[rid] -= k
        assert pc.problems() == []
    pc.tree   # (shares what the last pass completed)
    assert not pc._filling
    for ids in (short, long):
        keys = page_keys(ids, P).tolist()
        assert [int(pc.tree.key[i]) for i in pc.tree.match(np.array(keys, np.uint64))] == keys
    got = c.admit("again", 3900, 4, token_ids=long)
    assert got.cached_tokens == 15 * P   # every full page of "long", written while it ran


class _Releases(TreeAlloc):
    P = P

    def __init__(self) -> None:
        super().__init__()
        self.full = None
        self.released: list = []

    def release_checkpoint(self, unit, pages) -> None:
        self.released.append(unit)


def test_without_full_pages_a_node_stays_only_for_a_reader_a_node_below_or_a_resume_point():
    """A plan without a full-page pool has no page eviction to take nodes off its tree: it
    prunes the nodes nothing needs (Tree.prune), from a node up, as readers leave and resume
    points go."""
    from kvatlas.prefix.policy import POLICIES
    t = Tree(_Releases(), POLICIES["every-page"], PrefixStats(), reuse_weight=0.0)
    a = t.add(1, None, -1, now=1)
    b = t.add(2, a, -1, now=1)
    c = t.add(3, b, -1, now=1)
    d = t.add(4, a, -1, now=1)
    t.attach(b, Checkpoint(2 * P, 7, np.zeros(0, np.int64)), now=1)
    t.prune(c)   # c goes; b holds a resume point
    assert sorted(t.index) == [1, 2, 4]
    t.prune(d)   # d goes; a has b below it
    assert sorted(t.index) == [1, 2]
    t.ref([a, b])
    assert t.evict_checkpoint() and t.alloc.released == [7]   # the point goes; b has a reader
    assert sorted(t.index) == [1, 2] and t.checkpoints == 0
    t.unref([a, b], now=2)   # the reader leaves: b, then a
    assert t.index == {} and t._pages == [] and t.idle_pages == 0
    assert t.evicted_keys.keys() >= {1, 2, 3, 4} and t.stats.evicted_pages == 0   # (no page was freed)


def test_a_stage_without_compressed_layers_serving_many_requests_keeps_its_tree_bounded():
    """The last pipeline stage of tiny-v4 at pp=4 has no compressed layer (no full-page pool).
    Its tree grew by a node a page served, and its heap by an entry: 1,600 of each after 400
    requests of 4 pages. Now it keeps none once they finish; the books agree after each."""
    p = plan("tiny-v4", "64MiB", pp=4, pp_rank=3, max_model_len=2048, max_running_requests=4, prefix_checkpoints=8)
    assert not p.has_compressed
    c = allocate(p, backend="none")
    t, rng = c.prefix.tree, np.random.default_rng(0)
    for i in range(60):
        ids = rng.integers(0, 1000, 1024)
        c.admit(i, 1024, 8, token_ids=ids)
        for _ in range(4):
            c.extend(i, P)
        c.step([i])
        c.finish(i, token_ids=ids)
        c.check_integrity()
        assert len(t.index) == 0 and t._pages == [] and t.idle_pages == 0
    assert t._size == 64   # (the columns never grew)
