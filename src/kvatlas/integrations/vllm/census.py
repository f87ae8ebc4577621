"""Which KV cache group owns each block of vLLM's shared block pool (0.33.x and 0.34.x), counted at
stats time from vLLM's own state.

vLLM's groups draw block ids from one `BlockPool`: a block is owned by one group at a time, held
by requests (`ref_cnt > 0`) or free, and a free block that still carries a block hash is a prefix
cache entry nobody holds (evictable: it counts as free in `vllm:kv_cache_usage_perc`). The pool
keeps none of this per group, but the state it keeps answers it:

- `held[g]`: the distinct blocks in group g's manager's per-request block lists
  (`single_type_managers[g].req_to_blocks`, the null block excluded): O(blocks the requests hold);
- `cached[g]`: the pool's blocks with `ref_cnt == 0` and a block hash, by the group the hash
  carries (`get_group_id`): one pass over the pool's blocks.

Nothing is wrapped: vLLM's hot path (`allocate_slots`, `free`, the prefix cache's hits and
evictions) runs exactly its own code with the plugin loaded, and the count costs O(blocks) only
when it is read. The plugin reads it at most once per refresh interval (`plugin`), so its share
of the scheduler's time is that count over the interval. An earlier census moved counters inside
wrappers on the pool's methods; measured beside vLLM's scheduler it added 8% to `allocate_slots`
and more to `make_stats` (bench/RESULTS.md, issue 35).

`drift` compares the count with the pool's own free count: a held block outside every manager's
lists (0 while vLLM's bookkeeping and this count agree) shows rather than hides.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    """Counts per group from one scheduler's block pool and group managers (module doc)."""

    def __init__(self, pool, managers) -> None:
        from vllm.v1.core.kv_cache_utils import get_group_id
        self.pool, self.managers = pool, tuple(managers)
        self._group_of = get_group_id

    def counts(self) -> Counts:
        pool, group_of = self.pool, self._group_of
        held = []
        for manager in self.managers:
            ids: set[int] = set()
            for blocks in manager.req_to_blocks.values():
                ids.update([b.block_id for b in blocks])
            ids.discard(pool.null_block.block_id)
            held.append(len(ids))
        cached = [0] * len(self.managers)
        for b in pool.blocks:
            if b.block_hash is not None and b.ref_cnt == 0 and not b.is_null:
                cached[group_of(b.block_hash)] += 1
        return Counts(held=tuple(held), cached=tuple(cached), unattributed=0,
                      free=pool.get_num_free_blocks(), usable=pool.num_gpu_blocks - 1)
