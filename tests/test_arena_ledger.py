"""Contract: plan bytes == ledger tensor bytes == audit() bytes of the cache object, exactly."""

import pytest

torch = pytest.importorskip("torch")

import kvatlas  # noqa: E402
from kvatlas.cache.arena import cuda_block_bytes, cuda_segment_bytes  # noqa: E402
from kvatlas.errors import ConfigError  # noqa: E402
from kvatlas.planning.formats import LAYOUTS  # noqa: E402

SMALL = dict(max_running_requests=3, max_model_len=4096, chunked_prefill_tokens=512)


def cases():
    for name in kvatlas.preset_names():
        family = kvatlas.load_model(name).family
        for layout, lay in LAYOUTS.items():
            if lay.family == family:
                yield name, layout


@pytest.mark.parametrize("model,layout", list(cases()))
def test_plan_equals_tensor_equals_audit(model, layout):
    p = kvatlas.budget_for(model, 3, 4096, kv_layout=layout, chunked_prefill_tokens=512)
    cache = kvatlas.allocate(p, device="cpu")
    snap = cache.check_integrity()
    assert snap.planned_bytes == snap.tensor_bytes == p.total_bytes
    assert kvatlas.audit(cache).total_bytes == p.total_bytes
    assert snap.reserved_bytes == snap.physical_bytes == p.total_bytes  # CPU: backed as allocated
    assert snap.addressable_bytes == sum(b.addressable_bytes for b in p.buffers)
    assert snap.occupied_bytes == 0
    for name, pool in snap.pools.items():
        assert pool.measures.planned_bytes == sum(b.bytes for b in p.pools()[name])
    assert sum(m.tensor_bytes for m in snap.layer_kinds.values()) == p.total_bytes


def test_one_allocation_and_views_only():
    p = kvatlas.plan("deepseek-v4-flash", "2GiB", **SMALL)
    cache = kvatlas.allocate(p)
    report = kvatlas.audit(cache)
    assert report.num_storages == 1  # every pool is a view of the one slab
    base = cache.arena.backend.slab.untyped_storage().data_ptr()
    for region in cache.arena.regions.values():
        assert region.tensor.untyped_storage().data_ptr() == base
        assert region.tensor.data_ptr() == base + region.spec.offset_bytes


def test_layer_views_and_null_units():
    p = kvatlas.plan("deepseek-v4-flash", "2GiB", **SMALL)
    cache = kvatlas.allocate(p)
    c4 = cache.pools["c4_kv"]
    layer = c4.layers[3]
    view = c4.layer(layer)
    assert view.shape == (p.num_full_pages, 37_440)
    assert view.stride(0) == 21 * 37_440  # unit-major: pages of all layers are contiguous
    assert torch.count_nonzero(c4.tensor[0]) == 0  # the null page reads zeros
    assert torch.count_nonzero(cache.pools["block_table"].tables["full"]) == 0
    assert set(cache.layer_pools(layer)) == {"swa_kv", "c4_kv", "c4_indexer", "c4_state", "c4_indexer_state"}
    with pytest.raises(KeyError):
        cache.layer_pools(999)


def test_mem_usage_is_not_zero():
    p = kvatlas.plan("deepseek-v4-pro", "3GiB", **SMALL)
    cache = kvatlas.allocate(p)
    assert cache.ledger.mem_usage_gib == p.total_bytes / 2**30 > 0
    assert cache.ledger.snapshot().mem_usage_gib == cache.ledger.mem_usage_gib


def test_snapshot_is_frozen_and_versioned():
    cache = kvatlas.allocate(kvatlas.plan("tiny-v4", "64MiB", **SMALL))
    snap = cache.ledger.snapshot()
    assert snap.schema_version == 1
    with pytest.raises(Exception):
        snap.tensor_bytes = 0
    doc = snap.to_dict()
    assert doc["totals"]["tensor"] == snap.tensor_bytes and doc["schema"] == "kvatlas.ledger"


def test_cuda_allocator_rounding_model():
    assert cuda_block_bytes(1) == 512 and cuda_block_bytes(513) == 1024
    assert cuda_segment_bytes(1000) == 2 << 20          # small pool
    assert cuda_segment_bytes(5 << 20) == 20 << 20      # 1–10 MiB share a 20 MiB segment
    assert cuda_segment_bytes((120 << 30) + 1) == (120 << 30) + (2 << 20)


def test_unknown_backend_and_missing_cuda():
    p = kvatlas.plan("tiny-v4", "64MiB", **SMALL)
    with pytest.raises(ConfigError, match="backend"):
        kvatlas.allocate(p, backend="magic")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device"):
            kvatlas.allocate(p, device="cuda")


@pytest.mark.gpu
def test_cuda_allocation_matches_allocator_growth():
    p = kvatlas.plan("deepseek-v4-flash", "2GiB", **SMALL)
    torch.cuda.synchronize()
    a0, r0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    cache = kvatlas.allocate(p, device="cuda")
    snap = cache.check_integrity()
    assert torch.cuda.memory_allocated() - a0 == snap.tensor_bytes == p.total_bytes
    assert torch.cuda.memory_reserved() - r0 == snap.reserved_bytes
