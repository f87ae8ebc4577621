"""The eviction's credit for reuse (kvatlas.prefix.tree, module doc): a page requests have read
counts as used reuse_weight x lifetime x min(reads, REUSE_CAP) later than it was."""

from __future__ import annotations

import numpy as np
import pytest
from tree_fakes import TreeAlloc

import kvatlas
from kvatlas.errors import ConfigError
from kvatlas.prefix.stats import PrefixStats
from kvatlas.prefix.tree import REUSE_CAP, REUSE_WEIGHT, Tree




def _tree(weight: float, lifetime: float) -> Tree:
    t = Tree(TreeAlloc(), None, PrefixStats(), reuse_weight=weight)
    t.lifetime = lifetime   # as after a run whose evicted pages had lived that many admissions
    return t


def _read(t: Tree, node, now: int, times: int = 1) -> None:
    for _ in range(times):
        t.ref([node])
        t.unref([node], now)


def test_a_read_page_outlives_a_later_page_never_read():
    for weight, first_out in ((0.0, 1), (REUSE_WEIGHT, 2)):
        t = _tree(weight, 100.0)
        a = t.add(1, None, 11, now=10)
        b = t.add(2, None, 12, now=20)
        _read(t, a, 15)                        # read once, last at 15: plain LRU takes it before b (20)
        assert (t.reads[a], t.reads[b]) == (1, 0)
        assert t.evict_pages(1) == 1
        assert first_out not in t.nodes and len(t.nodes) == 1
        assert t.alloc.freed == [10 + first_out]
        assert t.stats.evicted_pages == 1


def test_the_credit_is_capped_and_scaled_by_the_lifetime():
    # b last used at 100, never read; a last used at 10, read 9 times: credit 0.5 * 40 * min(9, 4) = 80,
    # so a counts as used at 90 and goes first; with a lifetime of 50 the credit is 100 (used at 110)
    for lifetime, first_out in ((40.0, 1), (50.0, 2)):
        t = _tree(0.5, lifetime)
        a = t.add(1, None, 11, now=0)
        b = t.add(2, None, 12, now=100)
        _read(t, a, 10, times=9)
        assert t.reads[a] == 9 and REUSE_CAP == 4
        t.evict_pages(1)
        assert first_out not in t.nodes


def test_a_hold_is_not_a_read():
    t = _tree(0.5, 100.0)
    a = t.add(1, None, 11, now=10)
    t.ref([a], read=False)
    t.unref([a], 10)
    assert t.reads[a] == 0


def test_the_lifetime_follows_the_age_of_evicted_pages():
    t = _tree(0.5, 0.0)
    t.add(1, None, 11, now=0)
    t.add(2, None, 12, now=30)       # the latest use the tree has seen: 30
    t.evict_pages(1)                 # page 1, age 30: the mean moves 1% of the way
    assert t.lifetime == pytest.approx(0.3)
    t.evict_pages(1)                 # page 2, age 0
    assert t.lifetime == pytest.approx(0.3 * 0.99)


def test_leaves_still_go_first():
    t = _tree(0.5, 1000.0)
    root = t.add(1, None, 11, now=0)
    leaf = t.add(2, root, 12, now=5)
    _read(t, leaf, 6, times=4)       # the leaf has all the credit; its parent can only go after it
    assert t.evict_pages(1) == 1 and 2 not in t.nodes and 1 in t.nodes


def test_the_weight_reaches_the_tree_and_bad_ones_are_refused():
    p = kvatlas.plan("deepseek-v4-flash", "16GiB", prefix_checkpoints=64)
    assert kvatlas.allocate(p, backend="none").prefix.tree.reuse_weight == REUSE_WEIGHT
    assert kvatlas.allocate(p, backend="none", prefix_reuse_weight=0).prefix.tree.reuse_weight == 0.0
    for bad, said in ((-1, "-1 is out of range"), (float("nan"), "nan is out of range"),
                      (float("inf"), "inf is out of range"), (65, "65 is out of range"),
                      ("0.5", "'0.5' is not a number"), (True, "True is not a number")):
        with pytest.raises(ConfigError) as e:
            kvatlas.allocate(p, backend="none", prefix_reuse_weight=bad)
        assert str(e.value).startswith(f"prefix_reuse_weight: {said}; give a finite number"), str(e.value)
