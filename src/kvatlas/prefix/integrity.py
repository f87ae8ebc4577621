"""The prefix cache's books against a recount (called by KVCache.check_integrity).

What is recounted from scratch, not read from the counters the hot paths move:
- the tree: one node per cache-held full page, each page once (its id); the key index against
  the keys, parents, depths and child counts, idle pages and reference counts equal the running
  requests' reads (`full_refs`), and every column back to 0 where no node is;
- every cache-held SWA page has one owner story: the tail of a resume point on the tree, the tail
  of a capture a running request still holds (its tentative point or a kept one, each a pin), or
  an orphan that a running request still reads; and its reference count is exactly its readers
  (windows that list it) plus its pins;
- evictable units, per group, equal what evicting every evictable page and resume point would
  free: cache-held full pages nobody reads, cache-held SWA pages nobody reads or pins (they are
  tails of resume points on the tree: evicting those frees them), and every resume point on the
  tree (a running request never reads a unit; it copied its rows at admission);
- the requests still sharing pages as they write them: their keys by page, paths and marks
  as the sharing of many at once reads them (`_filling_problems`);
- the waiting queue: the keys the tree's eviction counts as awaited are exactly those of the
  requests enqueued and not yet admitted or dequeued, each with their queue orders, in order.
"""

from __future__ import annotations

import numpy as np

from ..alloc.sharing import CACHE_OWNER
from ..planning.buffers import CHECKPOINTS, FULL_PAGES, SWA_PAGES


def prefix_problems(pc) -> list[str]:
    a = pc.alloc
    out = _tree_problems(pc) + _path_problems(pc) + _queue_problems(pc) + _filling_problems(pc)
    pins = _pinned_tails(pc)
    if a.swa is not None:
        out += _swa_problems(pc, pins)
    if pc.ledger is not None:
        out += _evictable_problems(pc)
    return out


def _filling_problems(pc) -> list[str]:
    """What the sharing of many writers at once (PrefixCache._share_due) reads instead of each
    request: a filling request's keys by page past its path (`_slot_keys`), its path (`_paths`)
    and the path's length (the slot's shared pages; its pages are the table's, _path_problems),
    and that a request with a kept point waiting for its page is marked."""
    out, a = [], pc.alloc
    if not (pc._twice | pc._unplaced) <= pc._filling.keys():   # (a pass's end reads these for every slot in them)
        out.append("prefix: a slot marked to share page by page is not filling")
    for slot, req in pc._filling.items():
        i, n = len(req.path), len(req.keys)
        if not np.array_equal(pc._slot_keys[slot, i:n], req.keys[i:]):
            out.append(f"prefix: slot {slot}'s page keys differ from its request's")
        if pc._paths[slot] is not req.path:
            out.append(f"prefix: slot {slot}'s path is not its request's")
        if len(req.path) != int(a.full_shared[slot]):
            out.append(f"prefix: slot {slot} reads {len(req.path)} tree pages but shares {int(a.full_shared[slot])}")
        if req.kept and slot not in pc._unplaced:
            out.append(f"prefix: slot {slot} keeps a point for a page not shared yet, unmarked")
    return out


def _path_problems(pc) -> list[str]:
    """Each running request's path: a chain of nodes from the root, each below the one before
    (its sharing hangs new pages below the last), on the pages its block table lists."""
    a, t, out = pc.alloc, pc._tree, []
    live = set(t.index.values())
    for rid, req in pc.requests.items():
        if not req.path:
            continue
        ids = np.asarray(req.path, np.int64)
        if not live.issuperset(req.path) or np.any(t.parent[ids] != np.concatenate(([-1], ids[:-1]))):
            out.append(f"prefix: request {rid!r}'s path is not a chain of cached pages from the root")
        elif a.full is not None and not np.array_equal(a.full_table[a.slot_of[rid], :len(ids)], ids):
            out.append(f"prefix: request {rid!r} reads tree pages its block table does not list")
    return out


def _queue_problems(pc) -> list[str]:
    awaited: dict[int, set] = {}
    for order, keys in pc._queued.values():
        for k in keys:
            awaited.setdefault(k, set()).add(order)
    found = {k: set(orders) for k, orders in pc._tree.awaited.items()}
    if found != awaited:
        return [f"prefix queue: {len(found)} awaited keys in the tree's books, {len(awaited)} in the "
                f"{len(pc._queued)} queued requests' prompts (or their queue orders differ)"]
    unordered = sum(1 for orders in pc._tree.awaited.values() if list(orders) != sorted(orders))
    if unordered:   # (eviction reads a key's first waiting reader as its first entry)
        return [f"prefix queue: {unordered} awaited keys hold their queue orders out of order"]
    return []


def _tree_problems(pc) -> list[str]:
    """The tree's columns (kvatlas.prefix.tree) against a recount: the key index, parents, child
    counts, idle pages, resume points, and the pages and readers the allocator holds."""
    a, t, out = pc.alloc, pc.tree, []
    ids = np.fromiter(t.index.values(), np.int64, len(t.index))
    keys = np.fromiter(t.index.keys(), np.uint64, len(t.index))
    live = np.zeros(t._size, bool)
    live[ids] = True
    dead = ~live
    if len(np.unique(ids)) != len(ids) or np.any(t.key[ids] != keys):
        out.append("prefix tree: the key index and the nodes' keys disagree (or two keys share a node)")
    parents = t.parent[ids]
    up = parents[parents >= 0]
    if dead[up].any():
        out.append("prefix tree: a node hangs under a node no longer in the tree")
    if np.any(t.depth[ids] != np.where(parents >= 0, t.depth[np.maximum(parents, 0)] + 1, 1)):
        out.append("prefix tree: a node's depth is not its parent's plus one")
    children = np.bincount(up, minlength=t._size)
    if np.any(t.children[ids] != children[ids]):
        out.append("prefix tree: a node's child count disagrees with its children")
    for name in ("refs", "children", "reads", "due", "last_used", "depth", "key", "ck_evicted"):
        if getattr(t, name)[dead].any():
            out.append(f"prefix tree: {name} is set on an id no node holds")
    cks = [(i, t.ckpt[i]) for i in ids.tolist() if t.ckpt[i] is not None]
    if np.any(t.parent[dead] != -1) or len(t.ckpt) - t.ckpt.count(None) != len(cks) \
            or any(not live[i] for i in t.origin):
        out.append("prefix tree: a parent, resume point or origin is set on an id no node holds")
    idle = int(np.count_nonzero(t.refs[ids] == 0))
    if t.idle_pages != idle:
        out.append(f"prefix tree: {t.idle_pages} idle pages counted, {idle} found")
    if t.checkpoints != len(cks):
        out.append("prefix tree: resume point count disagrees with the nodes that hold one")
    if any(ck.node != i for i, ck in cks):
        out.append("prefix tree: a resume point names another node than the one it hangs on")
    marked = sum(1 for _, ck in cks if ck.end or ck.divergence)
    if t.marked != marked:
        out.append(f"prefix tree: {t.marked} end or divergence points counted, {marked} found")
    if a.full is not None:
        held = np.flatnonzero(a.full.owner == CACHE_OWNER)
        if not np.array_equal(np.sort(ids), held):   # held is sorted and unique: a page twice differs too
            out.append(f"prefix tree: {len(ids)} nodes but {len(held)} cache-held full pages, or a page twice")
        if len(ids) and np.any(a.full_refs[ids] != t.refs[ids]):
            out.append("prefix tree: a node's readers disagree with the allocator's full-page references")
    if a.ckpt is not None:
        units = [ck.unit for _, ck in cks]
        if units and np.any(a.ckpt.owner[np.array(units, np.int64)] != CACHE_OWNER):
            out.append("prefix tree: a resume point's unit is not held by the cache")
    return out


def _pinned_tails(pc) -> list[np.ndarray]:
    """SWA tails of the captures running requests hold: tentative points and kept ones not yet on
    the tree (each holds one pin on its pages)."""
    tails = [pc._tent_pages[:, s] for s in np.flatnonzero(pc._tent_u)]
    for req in pc.requests.values():
        tails += [np.asarray(ck.swa_pages, np.int64) for ck in req.kept if ck.node is None and ck.unit > 0]
    return tails


def _swa_problems(pc, pins) -> list[str]:
    a, out = pc.alloc, []
    n = len(a.swa.owner)
    held = a.swa.owner == CACHE_OWNER
    want = np.zeros(n, np.int64)
    for s in a.slot_of.values():   # readers: windows listing a cache-held page
        w = a.window_swa_pages(s)
        np.add.at(want, w[held[w]], 1)
    story = np.zeros(n, np.int64)
    for tail in pins:
        np.add.at(want, tail, 1)
        np.add.at(story, tail, 1)
    for ck in pc.tree.ckpt:
        if ck is not None:
            np.add.at(story, np.asarray(ck.swa_pages, np.int64), 1)
    orphan = a.swa_orphan[:n]
    if np.any(want[held] != a.swa_refs[:n][held]):
        bad = np.flatnonzero(held & (want != a.swa_refs[:n]))[:4]
        out.append(f"swa_pages: cache-held pages {bad.tolist()} have references {a.swa_refs[bad].tolist()}, "
                   f"their readers and pins are {want[bad].tolist()}")
    if np.any(a.swa_refs[:n][~held] != 0):
        out.append("swa_pages: a page no cache holds has references")
    if np.any(held & (story == 0) & ~orphan) or np.any(orphan & (story > 0)):
        out.append("swa_pages: a cache-held page is neither a resume point's tail, a pinned capture's, nor an orphan")
    if np.any(orphan & ((a.swa_refs[:n] == 0) | ~held)):
        out.append("swa_pages: an orphan page nobody reads was not freed")
    return out


def _evictable_problems(pc) -> list[str]:
    a, led = pc.alloc, pc.ledger.units_evictable
    want = {CHECKPOINTS: pc.tree.checkpoints}
    if a.full is not None:
        want[FULL_PAGES] = int(np.count_nonzero((a.full.owner == CACHE_OWNER) & (a.full_refs[: len(a.full.owner)] == 0)))
    if a.swa is not None:
        n = len(a.swa.owner)
        want[SWA_PAGES] = int(np.count_nonzero((a.swa.owner == CACHE_OWNER) & (a.swa_refs[:n] == 0)))
    return [f"ledger evictable {g}: {led.get(g, 0)} units counted, {v} recounted" for g, v in want.items()
            if led.get(g, 0) != v]
