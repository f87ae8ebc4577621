"""Which KV cache group owns each block of vLLM 0.33's shared block pool, kept as counters.

vLLM's groups draw block ids from one `BlockPool`: a block is owned by one group at a time, held
by requests (`ref_cnt > 0`) or free, and a free block that still carries a block hash is a prefix
cache entry nobody holds (evictable: it counts as free in `vllm:kv_cache_usage_perc`). The pool
keeps none of this per group. Counting it by walking requests or blocks each stats interval would
cost O(requests) or O(blocks); instead the census moves two counters per group at the pool's own
transitions, so a read is O(groups) whatever the number of running requests:

- `held[g]`: distinct blocks of group g with `ref_cnt > 0`;
- `cached[g]`: blocks of group g with `ref_cnt == 0` and a block hash (evictable).

The transitions, and where the census sees them (wrappers on the one pool object and a view of it
per group manager; vLLM's classes are not touched):
- a block leaves the free queue: `get_new_blocks` (the group's view names the group) and `touch`
  (a prefix hit; the block's group is known from when it was allocated);
- a block returns to it: `free_blocks` and `unpin_blocks`, when its `ref_cnt` reaches 0;
- a block gains or loses its hash: `_insert_block_hash`, `_remove_cached_block_hashes` (the only
  two places vLLM changes a block's hash one at a time; eviction on reuse goes through the second);
- `reset_prefix_cache` drops every hash: the census is counted again from vLLM's state.

Each wrapper costs O(blocks in the call), inside vLLM's own O(blocks) loop. A held block whose
group the census cannot name (a caller outside the group managers) is counted as `unattributed`;
`check()` compares the census with the pool's own free count, so drift shows rather than hides.
"""

from __future__ import annotations

from dataclasses import dataclass

NONE = -1


@dataclass(frozen=True, slots=True, kw_only=True)
class Counts:
    """One read of the census: per group, and the pool's own free count."""

    held: tuple[int, ...]       # blocks requests hold, per group
    cached: tuple[int, ...]     # blocks the prefix cache keeps and nobody holds, per group
    unattributed: int           # held blocks of no known group
    free: int                   # the pool's free blocks (cached ones included), from vLLM
    usable: int                 # blocks besides the null block

    @property
    def free_clean(self) -> int:
        """Free blocks holding no prefix-cache entry."""
        return self.free - sum(self.cached)

    @property
    def drift(self) -> int:
        """Held blocks by vLLM's count minus the census's (0 while the census is exact)."""
        return (self.usable - self.free) - (sum(self.held) + self.unattributed)


class BlockCensus:
    def __init__(self, pool, managers) -> None:
        self.pool, self.managers = pool, tuple(managers)
        self.owner = [NONE] * pool.num_gpu_blocks
        self.held = [0] * len(self.managers)
        self.cached = [0] * len(self.managers)
        self.unattributed = 0
        self.stale = self.warned = False
        self._orig: dict = {}
        self.recount()
        self._install()

    # ---- reading ------------------------------------------------------------------------

    def counts(self) -> Counts:
        pool = self.pool
        if self.stale:
            self.stale = False
            self._guard(self.recount)
        return Counts(held=tuple(self.held), cached=tuple(self.cached), unattributed=self.unattributed,
                      free=pool.get_num_free_blocks(), usable=pool.num_gpu_blocks - 1)

    def recount(self) -> None:
        """Count from vLLM's own state: O(blocks + the requests' block lists). At install and after
        a prefix-cache reset only."""
        from vllm.v1.core.kv_cache_utils import get_group_id
        owner = self.owner
        for g, manager in enumerate(self.managers):
            for blocks in manager.req_to_blocks.values():
                for b in blocks:
                    if not b.is_null:
                        owner[b.block_id] = g
        held, cached, unknown = [0] * len(self.managers), [0] * len(self.managers), 0
        for b in self.pool.blocks:
            if b.is_null:
                continue
            if b.ref_cnt == 0 and b.block_hash is not None:
                owner[b.block_id] = get_group_id(b.block_hash)
                cached[owner[b.block_id]] += 1
            elif b.ref_cnt > 0 and owner[b.block_id] == NONE:
                unknown += 1
            elif b.ref_cnt > 0:
                held[owner[b.block_id]] += 1
        self.held, self.cached, self.unattributed = held, cached, unknown

    # ---- the transitions ----------------------------------------------------------------

    def _group(self, b) -> int:
        g = self.owner[b.block_id]
        if g == NONE and b.block_hash is not None:
            from vllm.v1.core.kv_cache_utils import get_group_id
            g = self.owner[b.block_id] = get_group_id(b.block_hash)
        return g

    def _took(self, b, group: int) -> None:
        """A free block (ref_cnt 0) is about to be held."""
        g = self._group(b) if group == NONE else group
        if b.block_hash is not None and self.owner[b.block_id] != NONE:
            self.cached[self.owner[b.block_id]] -= 1
        self.owner[b.block_id] = g
        if g == NONE:
            self.unattributed += 1
        else:
            self.held[g] += 1

    def _released(self, b) -> None:
        """A held block's ref_cnt reached 0: it is free (and evictable if it has a hash)."""
        g = self._group(b)
        if g == NONE:
            self.unattributed -= 1
            return
        self.held[g] -= 1
        if b.block_hash is not None:
            self.cached[g] += 1

    # vLLM's own call runs exactly once in each wrapper, outside any bookkeeping; bookkeeping that
    # fails (`_guard`) never reaches vLLM: it marks the census stale, and the next read counts again

    def get_new_blocks(self, num_blocks: int, group: int = NONE):
        blocks = self._orig["get_new_blocks"](num_blocks)   # evictions pass through _remove_hashes
        self._guard(self._handed, blocks, group)
        return blocks

    def _handed(self, blocks, group: int) -> None:
        for b in blocks:
            self.owner[b.block_id] = group
            if group == NONE:
                self.unattributed += 1
            else:
                self.held[group] += 1

    def touch(self, blocks, group: int = NONE) -> None:
        self._guard(self._touching, blocks, group)
        self._orig["touch"](blocks)

    def _touching(self, blocks, group: int) -> None:
        taken: set[int] = set()
        for b in blocks:
            if not b.is_null and b.ref_cnt == 0 and b.block_id not in taken:
                taken.add(b.block_id)
                self._took(b, group)

    def _releases(self, blocks) -> None:
        pool, left = self.pool, {}
        for b in blocks:
            if b.is_null or (b.pool is not None and b.pool is not pool):
                continue
            n = left.get(b.block_id, b.ref_cnt) - 1
            left[b.block_id] = n
            if n == 0:
                self._released(b)

    def free_blocks(self, ordered_blocks) -> None:
        blocks = list(ordered_blocks)
        self._guard(self._releases, blocks)
        self._orig["free_blocks"](blocks)

    def unpin_blocks(self, blocks, on_reuse) -> None:
        blocks = list(blocks)
        self._guard(self._releases, blocks)
        self._orig["unpin_blocks"](blocks, on_reuse)

    def _insert_block_hash(self, key, block, num_tokens) -> None:
        had = block.block_hash is not None
        self._orig["_insert_block_hash"](key, block, num_tokens)
        if not had:
            self._guard(self._hashed, block)

    def _hashed(self, block) -> None:
        if block.block_hash is not None and block.ref_cnt == 0 and not block.is_null:
            g = self._group(block)
            if g != NONE:
                self.cached[g] += 1

    def _remove_cached_block_hashes(self, block):
        g = self._guard(self._cached_group, block)
        removed = self._orig["_remove_cached_block_hashes"](block)
        if g is not None and g != NONE and block.block_hash is None and not block.is_null:
            self.cached[g] -= 1
        return removed

    def _cached_group(self, block) -> int:
        return self._group(block) if block.block_hash is not None and block.ref_cnt == 0 else NONE

    def reset_prefix_cache(self) -> bool:
        ok = self._orig["reset_prefix_cache"]()
        if ok:
            self._guard(self.recount)
        return ok

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:
            if not self.warned:   # one line per census, however often it happens
                self.warned = True
                import logging
                logging.getLogger("vllm.plugins.kvatlas").warning(
                    "kvatlas: block census lost track (%s: %s); counting again from vLLM's state", type(exc).__name__, exc)
            self.stale = True
            return None

    # ---- installing ---------------------------------------------------------------------

    WRAPPED = ("get_new_blocks", "touch", "free_blocks", "unpin_blocks", "_insert_block_hash",
               "_remove_cached_block_hashes", "reset_prefix_cache")

    def _install(self) -> None:
        pool = self.pool
        for name in self.WRAPPED:
            self._orig[name] = getattr(pool, name)
            setattr(pool, name, getattr(self, name))
        for g, manager in enumerate(self.managers):
            manager.block_pool = group_view(pool, self, g)


class _Fixed:
    """A data descriptor: wins over the instance dict the view shares with the pool."""

    def __init__(self, value) -> None:
        self.value = value

    def __get__(self, obj, owner=None):
        return self.value

    def __set__(self, obj, value):
        raise AttributeError("a group view's block-handing methods are fixed")


def group_view(pool, census: BlockCensus, group: int):
    """The block pool as one group's manager sees it: an object of a subclass of the pool's class
    sharing the pool's attribute dict (every attribute, read or written, is the pool's own, at no
    cost per access), except the two calls that hand a manager blocks, which name the group."""
    import functools
    cls = type(f"{type(pool).__name__}GroupView", (type(pool),), {
        "get_new_blocks": _Fixed(functools.partial(census.get_new_blocks, group=group)),
        "touch": _Fixed(functools.partial(census.touch, group=group)),
        "__doc__": group_view.__doc__})
    view = object.__new__(cls)
    view.__dict__ = pool.__dict__
    return view
