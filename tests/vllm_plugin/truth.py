"""What vLLM's own state says each group holds, counted the slow way (every request's block list
and every block of the pool), for the tests to hold the plugin's O(groups) counters against."""


def held_and_cached(engine) -> tuple[list[int], list[int]]:
    from vllm.v1.core.kv_cache_utils import get_group_id
    coordinator = engine.kv_cache_manager.coordinator
    held = []
    for manager in coordinator.single_type_managers:
        ids = {b.block_id for blocks in manager.req_to_blocks.values() for b in blocks if not b.is_null}
        held.append(len(ids))
    cached = [0] * len(held)
    for b in coordinator.block_pool.blocks:
        if not b.is_null and b.ref_cnt == 0 and b.block_hash is not None:
            cached[get_group_id(b.block_hash)] += 1
    pool = coordinator.block_pool
    assert sum(held) == pool.num_gpu_blocks - 1 - pool.get_num_free_blocks(), \
        "a held block outside every request's list: the slow count misses it"
    return held, cached


def check_snapshot(tracker, engine) -> None:
    """Every pool of the plugin's snapshot against the slow count, to the byte."""
    snap = tracker.snapshot()
    held, cached = held_and_cached(engine)
    layout = tracker.layout
    bpb = layout.bytes_per_block
    for g in layout.groups:
        for part in g.parts:
            m = snap.pools[part.pool].measures
            b = part.bytes_per_block
            assert m.occupied_bytes - m.evictable_bytes == held[g.index] * b, (part.pool, held[g.index])
            assert m.evictable_bytes == cached[g.index] * b, (part.pool, cached[g.index])
            assert m.tensor_bytes == m.occupied_bytes
        pad = snap.pools.get(f"block_pad.{g.name}")
        if pad is not None:
            assert pad.measures.physical_bytes == (held[g.index] + cached[g.index]) * (bpb - g.page_bytes)
            assert pad.measures.addressable_bytes == 0
    assert snap.pools["unattributed"].measures.tensor_bytes == 0
    assert layout.allocation_bytes == layout.num_blocks * bpb
    # the pool's blocks, and under 0.34's extensible cache any committed beyond them
    assert snap.total.tensor_bytes == max(layout.committed_blocks, layout.num_blocks) * bpb
    for name, p in snap.pools.items():
        assert not p.measures.violations(name), p.measures.violations(name)
    check_board(tracker)


def check_board(tracker) -> None:
    """The values the stats interval writes (the affine sample map) equal the slow snapshot's samples."""
    from kvatlas.integrations.foreign import samples
    rows = samples(tracker.snapshot())
    fast = tracker.sample_map.values(tracker.census.counts())
    assert [r[:3] for r in rows] == tracker.sample_map.keys
    assert [r[3] for r in rows] == list(fast)
