"""The page tree: one node per cached full page, found by its chained key; resume points hang on
the node whose page ends at their boundary.

Nodes are columns, not objects. A node is a number, its id: its full page where the plan has a
full-page pool (the cache holds each such page once), else one the tree hands out from past the
pool's pages. Its fields (key, parent, depth, readers, last use, ...) are arrays indexed by id, and
`index` maps a key to its id. Pages a pass of writers completed join in a few vector calls and
one dict update (add_runs), not an object each. `nodes` gives read-only views (NodeView) for
reports and tests. Eviction: least recently used first, leaves first
(a page is dropped only when no cached page extends it), and never what a running request reads.

Reuse. A page that requests have read counts as used later than it was: `reuse_weight` × the
cache's lifetime × min(reads, REUSE_CAP), where the lifetime is the running mean age (in the
cache's clock, admissions) of the pages evicted so far, so the credit follows the budget: a few
admissions where pages live briefly, thousands where they live long. A page written once and never
read again goes before one a system prompt's followers keep reading, though both were last used
at once. 0: plain LRU.

Queued readers. A scheduler may tell the cache which requests wait for admission
(`PrefixCache.enqueue`): `awaited` maps each key their prompts would hit to the queue orders of
the requests that wait for it. Eviction takes the pages no waiting request will read first (LRU,
as above); only when those are gone does it take awaited ones, the page whose first waiting
reader is furthest back in the queue first (Belady's rule over the future the queue shows).
Resume points likewise: those on awaited pages go last.

Heaps with lazy deletion: an entry carries the stamp it was pushed with (and a page's entry its
due, last use plus credit, and the generation of the id it was pushed for: an id is reused once
its page is evicted and taken again); a popped entry whose node changed since (touched, gained a
child, read again, gone) is skipped. A node is pushed again
whenever it becomes evictable, so each evictable node always has one live entry.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..checks import real

_EVICTED_MEMORY = 1 << 20   # keys remembered as evicted, for the miss reason
REUSE_WEIGHT = 0.5          # (module doc) chosen on the Mooncake trace: bench/RESULTS.md, "Eviction that counts reuse"
REUSE_WEIGHT_MAX = 64.0
REUSE_CAP = 4               # reads counted at most
_LIFE_RATE = 0.01           # the lifetime's running mean: each eviction moves it by 1%


def checked_reuse_weight(value, field: str = "reuse_weight") -> float:
    """`value` as a reuse weight (module doc): a finite number in [0, REUSE_WEIGHT_MAX]."""
    return real(field, value, 0.0, REUSE_WEIGHT_MAX)


def _first(orders: dict) -> int:
    """The earliest queue order of an `awaited` entry: its first key (Tree.awaited)."""
    return next(iter(orders))


class Checkpoint:
    __slots__ = ("boundary_tokens", "unit", "swa_pages", "end", "divergence", "node", "last_used")

    def __init__(self, boundary_tokens, unit, swa_pages) -> None:
        self.boundary_tokens, self.unit, self.swa_pages = boundary_tokens, unit, swa_pages
        self.end = self.divergence = False
        self.node = None     # the id of the node it hangs on (None: not on the tree)
        self.last_used = 0


@dataclass(frozen=True, slots=True)
class Evicted:
    """What the evictor hook sees before the storage is freed (see the host tier)."""
    kind: str               # "page" | "checkpoint"
    key: int
    parent_key: int
    depth_pages: int
    full_page: int = -1
    boundary_tokens: int = 0
    unit: int = 0
    swa_pages: tuple = ()


class NodeView:
    """A node's fields as they are now (read-only; reports and tests): the tree keeps columns."""
    __slots__ = ("tree", "id")

    def __init__(self, tree, i: int) -> None:
        self.tree, self.id = tree, i

    def __eq__(self, other) -> bool:
        return isinstance(other, NodeView) and other.tree is self.tree and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"NodeView(id={self.id}, key={self.key}, depth={self.depth})"

    key = property(lambda s: int(s.tree.key[s.id]))
    depth = property(lambda s: int(s.tree.depth[s.id]))
    page = property(lambda s: s.tree.page_of(s.id))
    refs = property(lambda s: int(s.tree.refs[s.id]))
    children = property(lambda s: int(s.tree.children[s.id]))
    last_used = property(lambda s: int(s.tree.last_used[s.id]))
    reads = property(lambda s: int(s.tree.reads[s.id]))
    due = property(lambda s: int(s.tree.due[s.id]))
    checkpoint = property(lambda s: s.tree.ckpt[s.id])
    checkpoint_evicted = property(lambda s: bool(s.tree.ck_evicted[s.id]))
    origin = property(lambda s: s.tree.origin.get(s.id))

    @property
    def parent(self):
        p = int(self.tree.parent[self.id])
        return NodeView(self.tree, p) if p >= 0 else None


class _Nodes:
    """The tree's nodes by key, as views (Tree.nodes)."""
    __slots__ = ("tree",)

    def __init__(self, tree) -> None:
        self.tree = tree

    def __len__(self) -> int:
        return len(self.tree.index)

    def __contains__(self, key) -> bool:
        return key in self.tree.index

    def __iter__(self):
        return iter(self.tree.index)

    def keys(self):
        return self.tree.index.keys()

    def get(self, key, default=None):
        i = self.tree.index.get(key)
        return default if i is None else NodeView(self.tree, i)

    def __getitem__(self, key):
        return NodeView(self.tree, self.tree.index[key])

    def values(self):
        return [NodeView(self.tree, i) for i in self.tree.index.values()]

    def items(self):
        return [(k, NodeView(self.tree, i)) for k, i in self.tree.index.items()]


_COLUMNS = ("key", "parent", "depth", "refs", "children", "last_used", "reads", "due", "gen", "ck_evicted")


class Tree:
    def __init__(self, allocator, policy, stats, ledger=None, reuse_weight: float = REUSE_WEIGHT) -> None:
        self.alloc, self.policy, self.stats, self.ledger = allocator, policy, stats, ledger
        self.reuse_weight = reuse_weight
        self.lifetime = 0.0        # mean age of evicted pages, in the cache's clock (module doc)
        self._now = 0              # the latest last_used seen
        self.index: dict[int, int] = {}   # key -> node id
        # ids below `base` are full pages; pageless nodes (a plan without a full-page pool) take
        # ids from `base` up, given back when evicted
        self.base = len(allocator.full.owner) if allocator.full is not None else 0
        self._spare_ids: list = []
        self._next_id = self.base
        self._size = 0
        self.ckpt: list = []       # id -> its resume point (Checkpoint) or None
        self.origin: dict = {}     # id -> the lower tier it came back from, until an admission first reads it
        self._grow(max(self.base, 64))
        self.checkpoints = 0
        self.marked = 0            # of them, ends and divergence points (the policy's refit reads it)
        self.idle_pages = 0        # nodes no running request reads: all evictable, leaves first
        self.evictor = None
        self._pages: list = []     # (last_used + reuse credit, seq, last_used as pushed, id, generation)
        self._ckpts: list = []     # (class, last_used, seq, checkpoint)
        self._seq = 0
        self.evicted_keys: OrderedDict = OrderedDict()
        # key -> {queue order of a waiting request that reads it: None}, in queue order (orders only
        # grow, PrefixCache.enqueue): a key's first waiting reader is its first entry
        self.awaited: dict[int, dict] = {}

    def _grow(self, size: int) -> None:
        """Columns for ids below `size`. A field is 0 (parent -1) wherever no node is: eviction
        puts back what a node changed, so a new node writes only what differs."""
        old = self._size
        for name in _COLUMNS:
            dtype = np.uint64 if name == "key" else bool if name == "ck_evicted" else np.int64
            col = np.zeros(size, dtype) if name != "parent" else np.full(size, -1, np.int64)
            if old:
                col[:old] = getattr(self, name)
            setattr(self, name, col)
        self.ckpt += [None] * (size - old)
        self._size = size

    @property
    def nodes(self) -> _Nodes:
        """The nodes by key, as read-only views (NodeView)."""
        return _Nodes(self)

    def page_of(self, i: int) -> int:
        """The node's full page (-1: the plan has no full-page pool)."""
        return i if i < self.base else -1

    def pages_of(self, ids) -> np.ndarray:
        """The full pages of nodes `ids` (-1 each where the plan has no full-page pool)."""
        if self.base:
            return np.array(ids, np.int64)
        return np.full(len(ids), -1, np.int64)

    # ---------------------------------------------------------------- lookup
    def match(self, keys) -> list[int]:
        """The ids of the leading pages of `keys` the tree holds."""
        path, index = [], self.index
        for k in keys.tolist():
            i = index.get(k)
            if i is None:
                break
            path.append(i)
        return path

    def evicted_run(self, keys, start: int) -> int:
        """Pages from `start` whose keys were cached once and evicted (a miss reason)."""
        n = 0
        for k in keys[start:].tolist():
            if k not in self.evicted_keys:
                break
            n += 1
        return n

    # ---------------------------------------------------------------- references
    def ref(self, path, read: bool = True) -> None:
        """One reference more on each node of `path` (ids, each once). read=False: a hold, not a
        read (the reuse credit does not count it)."""
        if not path:
            return
        ids = np.asarray(path, np.int64)
        refs = self.refs
        self.idle_pages -= int(np.count_nonzero(refs[ids] == 0))
        refs[ids] += 1
        if read:
            self.reads[ids] += 1

    def unref(self, path, now: int) -> None:
        if not path:
            return
        ids = np.asarray(path, np.int64)
        refs = self.refs
        refs[ids] -= 1
        self.last_used[ids] = now
        idle = ids[refs[ids] == 0]
        if len(idle):
            self.idle_pages += len(idle)
            for i in idle[self.children[idle] == 0].tolist():
                if self.base:
                    self._push_page(i)
                else:
                    self.prune(i)

    def prune(self, i: int) -> None:
        """A plan without a full-page pool (a pipeline stage with no compressed layer) has no
        pages to evict, so nothing would ever take a node off its tree: it would grow by a node a
        page served. There a node stays only while a running request reads it, a node below it
        stays, or it holds a resume point (what a hit resumes at); from node `i` up, the first
        nodes that are none of these leave the tree (the miss reason remembers their keys). A
        plan with full pages evicts by the heap instead (evict_pages): nothing happens here."""
        if self.base:
            return
        refs, children, parent, ckpt = self.refs, self.children, self.parent, self.ckpt
        while i >= 0 and not (refs[i] or children[i]) and ckpt[i] is None:
            up = int(parent[i])
            self._evict(i, [])
            i = up

    def _new_id(self, page: int) -> int:
        if page >= 0:
            return page
        if self._spare_ids:
            return self._spare_ids.pop()
        i = self._next_id
        self._next_id += 1
        if i >= self._size:
            self._grow(2 * self._size)
        return i

    def add(self, key, parent, page, now: int) -> int:
        """A node no request reads yet (an idle leaf, so it gets a heap entry), below the node
        `parent` (an id; None: the root); returns its id."""
        i = self._new_id(page)
        if parent is not None:
            self.children[parent] += 1
            self.depth[i] = self.depth[parent] + 1
        else:
            self.depth[i] = 1
        self.parent[i] = -1 if parent is None else parent
        self.key[i] = key
        self.last_used[i] = now
        self.gen[i] += 1
        self.idle_pages += 1
        self.index[key] = i
        if self.evicted_keys:
            self.evicted_keys.pop(key, None)
        self._push_page(i)
        return i

    def add_runs(self, paths, counts, keys, pages, now: int, ends=None) -> None:
        """The pages writers completed: for each path of `paths` (lists of ids) in turn, `counts`
        of them new nodes, each below the one before (the first below the path's last node, or
        the root), appended to the path; `keys` (a list) and `pages` (full pages, an array: the
        nodes' ids), one per node, in the same order. `ends`, if given: the paths' last nodes
        (-1: empty) and their lengths, two arrays (a caller that has them in its tables spares
        reading each path). Each node's first reader comes with it (its writer), so none is
        evictable and none gets a heap entry until its last reader leaves (unref pushes one).
        One call for a pass's writers (most complete one page each): the columns are set in
        vector calls."""
        ids = np.asarray(pages, np.int64)
        if ends is None:
            ends = (np.fromiter((p[-1] if p else -1 for p in paths), np.int64, len(paths)),
                    np.fromiter(map(len, paths), np.int64, len(paths)))
        heads, lengths = ends
        idl = ids.tolist()
        if len(ids) == len(paths):   # one page each (most passes)
            parents, depths = heads, lengths + 1
        else:
            counts = np.asarray(counts, np.int64)
            last = np.cumsum(counts) - 1
            firsts = last + 1 - counts
            parents = np.empty(len(ids), np.int64)
            parents[1:] = ids[:-1]
            parents[firsts] = heads
            depths = np.repeat(lengths - firsts, counts) + np.arange(1, len(ids) + 1)
            inner = np.ones(len(ids), bool)   # (each page but a run's last has the next below it)
            inner[last] = False
            self.children[ids[inner]] = 1
        self.parent[ids] = parents
        self.depth[ids] = depths
        self.key[ids] = keys
        self.refs[ids] = 1
        self.last_used[ids] = now
        self.gen[ids] += 1
        below = heads[heads >= 0]
        if len(below):
            np.add.at(self.children, below, 1)
        self.index.update(zip(keys, idl))
        if len(ids) == len(paths):
            for path, i in zip(paths, idl):
                path.append(i)
        else:
            at = 0
            for path, n in zip(paths, counts.tolist()):
                path += idl[at:at + n]
                at += n
        if now > self._now:
            self._now = now
        evicted = self.evicted_keys
        if evicted:
            for k in keys:
                evicted.pop(k, None)

    def attach(self, i: int, ck, now: int) -> None:
        self.ckpt[i], ck.node, ck.last_used = ck, i, now
        self.ck_evicted[i] = False
        self.checkpoints += 1
        self.marked += ck.end or ck.divergence
        if self.ledger is not None:
            self.ledger.add_evictable("checkpoints", 1)
        self._push_ckpt(ck)

    def mark_end(self, ck, now: int) -> None:
        """A kept point turns out to be its request's end: its eviction class may rise."""
        if ck.node is not None and not (ck.end or ck.divergence):
            self.marked += 1
        ck.end = True
        if ck.node is not None:
            self.touch_checkpoint(ck, now)

    def touch_checkpoint(self, ck, now: int) -> None:
        ck.last_used = now
        self._push_ckpt(ck)

    def _push_page(self, i: int):
        """Push the node's heap entry if it is an idle leaf; returns the entry (else None). A plan
        without a full-page pool keeps no heap: nothing asks it for pages (see prune)."""
        if self.base and self.refs[i] == 0 and self.children[i] == 0:
            self._seq += 1
            stamp = used = int(self.last_used[i])
            if used > self._now:
                self._now = used
            reads = int(self.reads[i])
            if reads and self.reuse_weight:
                used += int(self.reuse_weight * self.lifetime * min(reads, REUSE_CAP))
            self.due[i] = used   # (an older entry of the same last use but less credit is stale)
            entry = (used, self._seq, stamp, i, int(self.gen[i]))
            heapq.heappush(self._pages, entry)
            return entry
        return None

    def _push_ckpt(self, ck) -> None:
        self._seq += 1
        cls = self.policy.eviction_class(end=ck.end, divergence=ck.divergence, page=ck.boundary_tokens // self.alloc.P)
        heapq.heappush(self._ckpts, (cls, ck.last_used, self._seq, ck))

    # ---------------------------------------------------------------- eviction
    def evict_pages(self, need: int) -> int:
        """Free up to `need` full pages, leaves first: those no waiting request reads in LRU
        order, then awaited ones, furthest back in the queue first (module doc); returns how many
        (0 on a plan without a full-page pool: it has none to free)."""
        if not self.base:
            return 0
        freed, aside, awaited = [], [], self.awaited
        while len(freed) < need and self._pages:
            entry = heapq.heappop(self._pages)
            if not self._evictable(entry):
                continue
            i = entry[3]
            if awaited and int(self.key[i]) in awaited:
                aside.append(entry)   # (pushed back below: its entry stays live)
                continue
            self._evict(i, freed)
        if aside:
            if len(freed) < need:
                self._evict_awaited(need, aside, freed)
            for entry in aside:
                heapq.heappush(self._pages, entry)
        if freed:
            self.alloc.evict_full(np.array(freed, np.int64))
        self.stats.evicted_pages += len(freed)
        return len(freed)

    def _evictable(self, entry) -> bool:
        """The heap entry is its node's live one: in the tree, an idle leaf, unchanged since."""
        due, _, stamp, i, gen = entry
        return self.gen[i] == gen and not (self.refs[i] or self.children[i]) and stamp == self.last_used[i] \
            and due == self.due[i]

    def _evict_awaited(self, need: int, aside: list, freed: list) -> None:
        """Only awaited idle leaves are left (`aside`, live entries): evict the ones whose first
        waiting reader is latest in the queue first; a parent left a leaf joins them."""
        awaited, far = self.awaited, []

        def push(entry) -> None:
            orders = awaited.get(int(self.key[entry[3]]))
            heapq.heappush(far, (-_first(orders) if orders else -(1 << 62), entry[0], entry[1], entry))

        for entry in aside:
            push(entry)
        while len(freed) < need and far:
            entry = heapq.heappop(far)[3]
            if not self._evictable(entry):
                continue
            i = entry[3]
            self.stats.evicted_awaited_pages += int(self.key[i]) in awaited
            entry = self._evict(i, freed)
            if entry is not None:
                push(entry)

    def _evict(self, i: int, freed: list):
        """Take an idle leaf off the tree (its page appended to `freed`); returns the heap entry of
        its parent if that became an idle leaf (else None). Its fields go back to 0 (module doc)."""
        self.lifetime += _LIFE_RATE * ((self._now - int(self.last_used[i])) - self.lifetime)
        if self.ckpt[i] is not None:
            self.drop_checkpoint(self.ckpt[i])
        key, parent = int(self.key[i]), int(self.parent[i])
        if i < self.base:   # (a pageless node has no page for a lower tier to take)
            self._hook(Evicted("page", key, int(self.key[parent]) if parent >= 0 else 0, int(self.depth[i]),
                               full_page=i))
        del self.index[key]
        self.idle_pages -= 1
        self._remember(key)
        self.gen[i] += 1
        self.parent[i] = -1
        self.reads[i] = self.due[i] = self.last_used[i] = self.depth[i] = self.key[i] = 0
        self.ck_evicted[i] = False
        if self.origin:
            self.origin.pop(i, None)
        if i < self.base:
            freed.append(i)
        else:
            self._spare_ids.append(i)
        if parent < 0:
            return None
        self.children[parent] -= 1
        return self._push_page(parent)

    def evict_checkpoint(self, keep=None) -> bool:
        """Free one checkpoint unit (the allocator asks when a capture finds none free): the first
        in eviction order that no waiting request would resume at, else of those, the one whose
        first waiting reader is furthest back in the queue (module doc). keep: a point never
        taken (the one an admission in progress resumes at)."""
        aside, awaited, found, kept = [], self.awaited, None, None
        while self._ckpts:
            entry = heapq.heappop(self._ckpts)
            ck = entry[3]
            i = ck.node
            if i is None or self.ckpt[i] is not ck or entry[1] != ck.last_used:
                continue
            if ck is keep:
                kept = entry
                continue
            if awaited and int(self.key[i]) in awaited:
                aside.append(entry)
                continue
            found = ck
            break
        if found is None and aside:
            far = max(aside, key=lambda e: _first(awaited[int(self.key[e[3].node])]))
            aside.remove(far)
            found = far[3]
        for entry in aside:
            heapq.heappush(self._ckpts, entry)
        if kept is not None:
            heapq.heappush(self._ckpts, kept)
        if found is None:
            return False
        i = found.node
        self.drop_checkpoint(found)
        self.prune(i)   # (a plan without full pages: the node may have held nothing else)
        return True

    def drop_checkpoint(self, ck) -> None:
        i = ck.node
        parent = int(self.parent[i])
        self._hook(Evicted("checkpoint", int(self.key[i]), int(self.key[parent]) if parent >= 0 else 0,
                           int(self.depth[i]), boundary_tokens=ck.boundary_tokens, unit=ck.unit,
                           swa_pages=tuple(ck.swa_pages.tolist())))
        self.ckpt[i], ck.node = None, None
        self.ck_evicted[i] = True
        self.checkpoints -= 1
        self.marked -= ck.end or ck.divergence
        if self.ledger is not None:
            self.ledger.add_evictable("checkpoints", -1)
        self.alloc.release_checkpoint(ck.unit, ck.swa_pages)
        ck.unit = -1   # (it holds no unit now: a stale reference to it, a finished request's kept list, must not free it again)
        self.stats.evicted_checkpoints += 1

    def _hook(self, entry) -> None:
        if self.evictor is not None:
            self.evictor.on_evict(entry)

    def _remember(self, key) -> None:
        self.evicted_keys[key] = None
        if len(self.evicted_keys) > _EVICTED_MEMORY:
            self.evicted_keys.popitem(last=False)
