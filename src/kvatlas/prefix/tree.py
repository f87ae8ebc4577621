"""The page tree: one node per cached full page, found by its chained key; resume points hang on
the node whose page ends at their boundary. Eviction: least recently used first, leaves first
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
due, last use plus credit); a popped entry whose node changed since (touched, gained a child, read
again, gone) is skipped. A node is pushed again
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
        self.node = None
        self.last_used = 0


class Node:
    __slots__ = ("key", "parent", "depth", "page", "checkpoint", "children", "refs", "last_used",
                 "checkpoint_evicted", "origin", "reads", "due")

    def __init__(self, key, parent, depth, page, refs: int = 0, last_used: int = 0) -> None:
        self.key, self.parent, self.depth, self.page = key, parent, depth, page
        self.checkpoint = None
        self.children = 0
        self.refs, self.last_used = refs, last_used
        self.reads = 0       # requests that have read it (its writer's own read not counted)
        self.due = 0         # the eviction order of its latest heap entry (last use + reuse credit)
        self.checkpoint_evicted = False
        self.origin = None   # the lower tier it came back from, until an admission first reads it


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


class Tree:
    def __init__(self, allocator, policy, stats, ledger=None, reuse_weight: float = REUSE_WEIGHT) -> None:
        self.alloc, self.policy, self.stats, self.ledger = allocator, policy, stats, ledger
        self.reuse_weight = reuse_weight
        self.lifetime = 0.0        # mean age of evicted pages, in the cache's clock (module doc)
        self._now = 0              # the latest last_used seen
        self.nodes: dict[int, Node] = {}
        self.checkpoints = 0
        self.marked = 0            # of them, ends and divergence points (the policy's refit reads it)
        self.idle_pages = 0        # nodes no running request reads: all evictable, leaves first
        self.evictor = None
        self._pages: list = []     # (last_used + reuse credit, seq, last_used as pushed, node)
        self._ckpts: list = []     # (class, last_used, seq, checkpoint)
        self._seq = 0
        self.evicted_keys: OrderedDict = OrderedDict()
        # key -> {queue order of a waiting request that reads it: None}, in queue order (orders only
        # grow, PrefixCache.enqueue): a key's first waiting reader is its first entry
        self.awaited: dict[int, dict] = {}

    # ---------------------------------------------------------------- lookup
    def match(self, keys) -> list[Node]:
        path, nodes = [], self.nodes
        for k in keys.tolist():
            node = nodes.get(k)
            if node is None:
                break
            path.append(node)
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
        """read=False: a hold, not a read (the reuse credit does not count it)."""
        for node in path:
            if node.refs == 0:
                self.idle_pages -= 1
            node.refs += 1
            node.reads += read

    def unref(self, path, now: int) -> None:
        for node in path:
            node.refs -= 1
            node.last_used = now
            if node.refs == 0:
                self.idle_pages += 1
                self._push_page(node)

    def add(self, key, parent, page, now: int) -> Node:
        """A node no request reads yet (an idle leaf, so it gets a heap entry)."""
        if parent is not None:
            parent.children += 1
        node = Node(key, parent, parent.depth + 1 if parent is not None else 1, page, last_used=now)
        self.idle_pages += 1
        self.nodes[key] = node
        if self.evicted_keys:
            self.evicted_keys.pop(key, None)
        self._push_page(node)
        return node

    def add_runs(self, paths, counts, keys, pages, now: int) -> None:
        """The pages writers completed: for each path of `paths` in turn, `counts` of them new
        nodes, each below the one before (the first below the path's last node, or the root),
        appended to the path; `keys` and `pages`, one per node, in the same order. Each node's
        first reader comes with it (its writer), so none is evictable and none gets a heap entry
        until its last reader leaves (unref pushes one). One call for a pass's writers (most
        complete one page each)."""
        made, at = [], 0
        for path, n in zip(paths, counts):
            parent = path[-1] if path else None
            depth = parent.depth if parent is not None else 0
            end = at + n
            while at < end:   # (no slice of keys a writer: most complete one page)
                if parent is not None:
                    parent.children += 1
                depth += 1
                node = Node(keys[at], parent, depth, pages[at], 1, now)
                at += 1
                path.append(node)
                made.append(node)
                parent = node
        self.nodes.update(zip(keys, made))
        if now > self._now:
            self._now = now
        evicted = self.evicted_keys
        if evicted:
            for k in keys:
                evicted.pop(k, None)

    def attach(self, node, ck, now: int) -> None:
        node.checkpoint, ck.node, ck.last_used = ck, node, now
        node.checkpoint_evicted = False
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

    def _push_page(self, node):
        """Push the node's heap entry if it is an idle leaf; returns the entry (else None)."""
        if node.refs == 0 and node.children == 0:
            self._seq += 1
            used = node.last_used
            if used > self._now:
                self._now = used
            if node.reads and self.reuse_weight:
                used += int(self.reuse_weight * self.lifetime * min(node.reads, REUSE_CAP))
            node.due = used   # (an older entry of the same last use but less credit is stale)
            entry = (used, self._seq, node.last_used, node)
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
        order, then awaited ones, furthest back in the queue first (module doc); returns how many."""
        freed, aside, awaited = [], [], self.awaited
        while len(freed) < need and self._pages:
            entry = heapq.heappop(self._pages)
            node = entry[3]
            if not self._evictable(entry):
                continue
            if awaited and node.key in awaited:
                aside.append(entry)   # (pushed back below: its entry stays live)
                continue
            self._evict(node, freed)
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
        due, _, stamp, node = entry
        return self.nodes.get(node.key) is node and not (node.refs or node.children) and stamp == node.last_used \
            and due == node.due

    def _evict_awaited(self, need: int, aside: list, freed: list) -> None:
        """Only awaited idle leaves are left (`aside`, live entries): evict the ones whose first
        waiting reader is latest in the queue first; a parent left a leaf joins them."""
        awaited, far = self.awaited, []

        def push(entry) -> None:
            orders = awaited.get(entry[3].key)
            heapq.heappush(far, (-_first(orders) if orders else -(1 << 62), entry[0], entry[1], entry))

        for entry in aside:
            push(entry)
        while len(freed) < need and far:
            entry = heapq.heappop(far)[3]
            node = entry[3]
            if not self._evictable(entry):
                continue
            self.stats.evicted_awaited_pages += node.key in awaited
            entry = self._evict(node, freed)
            if entry is not None:
                push(entry)

    def _evict(self, node, freed: list):
        """Take an idle leaf off the tree (its page appended to `freed`); returns the heap entry of
        its parent if that became an idle leaf (else None)."""
        self.lifetime += _LIFE_RATE * ((self._now - node.last_used) - self.lifetime)
        if node.checkpoint is not None:
            self.drop_checkpoint(node.checkpoint)
        self._hook(Evicted("page", node.key, node.parent.key if node.parent else 0, node.depth,
                           full_page=node.page))
        del self.nodes[node.key]
        self.idle_pages -= 1
        self._remember(node.key)
        if node.page >= 0:
            freed.append(node.page)
        parent = node.parent
        if parent is None:
            return None
        parent.children -= 1
        return self._push_page(parent)

    def evict_checkpoint(self) -> bool:
        """Free one checkpoint unit (the allocator asks when a capture finds none free): the first
        in eviction order that no waiting request would resume at, else of those, the one whose
        first waiting reader is furthest back in the queue (module doc)."""
        aside, awaited, found = [], self.awaited, None
        while self._ckpts:
            entry = heapq.heappop(self._ckpts)
            ck = entry[3]
            node = ck.node
            if node is None or node.checkpoint is not ck or entry[1] != ck.last_used:
                continue
            if awaited and node.key in awaited:
                aside.append(entry)
                continue
            found = ck
            break
        if found is None and aside:
            far = max(aside, key=lambda e: _first(awaited[e[3].node.key]))
            aside.remove(far)
            found = far[3]
        for entry in aside:
            heapq.heappush(self._ckpts, entry)
        if found is None:
            return False
        self.drop_checkpoint(found)
        return True

    def drop_checkpoint(self, ck) -> None:
        node = ck.node
        self._hook(Evicted("checkpoint", node.key, node.parent.key if node.parent else 0, node.depth,
                           boundary_tokens=ck.boundary_tokens, unit=ck.unit, swa_pages=tuple(ck.swa_pages.tolist())))
        node.checkpoint, ck.node = None, None
        node.checkpoint_evicted = True
        self.checkpoints -= 1
        self.marked -= ck.end or ck.divergence
        if self.ledger is not None:
            self.ledger.add_evictable("checkpoints", -1)
        self.alloc.release_checkpoint(ck.unit, ck.swa_pages)
        self.stats.evicted_checkpoints += 1

    def _hook(self, entry) -> None:
        if self.evictor is not None:
            self.evictor.on_evict(entry)

    def _remember(self, key) -> None:
        self.evicted_keys[key] = None
        if len(self.evicted_keys) > _EVICTED_MEMORY:
            self.evicted_keys.popitem(last=False)
