"""The vmm backend on a real GPU (CUDA driver through cuda-python). Skipped without CUDA; the
CPU tests of the same bookkeeping use the stand-in driver (test_vmm_lifecycle.py)."""

import pytest

torch = pytest.importorskip("torch")

import kvatlas  # noqa: E402
from kvatlas import PoolExhaustedError  # noqa: E402

pytestmark = pytest.mark.gpu


def _free_bytes():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _cache(**opts):
    pytest.importorskip("cuda.bindings")
    p = kvatlas.budget_for("deepseek-v4-flash", 16, 8192, chunked_prefill_tokens=2048)
    return kvatlas.allocate(p, device="cuda", backend="vmm", **opts)


def test_free_memory_drop_equals_physical_bytes():
    pytest.importorskip("cuda.bindings")
    torch.zeros(1, device="cuda")
    base = _free_bytes()
    cache = _cache(keep_empty_chunks=0)
    snap = cache.check_integrity()
    assert base - _free_bytes() == snap.physical_bytes < snap.tensor_bytes <= snap.reserved_bytes
    for r in range(8):
        cache.admit(r, 4000)
        cache.extend(r, 2000)
        cache.extend(r, 2000)
        assert base - _free_bytes() == cache.check_integrity().physical_bytes
    for r in range(8):
        cache.finish(r)
        assert base - _free_bytes() == cache.check_integrity().physical_bytes
    cache.close()
    assert _free_bytes() == base


def test_data_survives_other_chunks_mapping_and_unmapping():
    cache = _cache(keep_empty_chunks=0)
    cache.admit("keep", 4000)
    cache.extend("keep", 2000)
    a = cache.allocator
    pages = a.full_table[a.slot_of["keep"], :8]
    c4 = cache.pools["c4_kv"].tensor
    c4[pages] = 77
    for r in range(6):               # others come and go: chunks mapped and unmapped around it
        cache.admit(r, 4000)
        cache.extend(r, 2000)
    for r in range(6):
        cache.finish(r)
    torch.cuda.synchronize()
    assert bool(torch.all(c4[pages] == 77))
    cache.check_integrity()
    cache.close()


def test_physical_cap_refuses_with_nothing_changed():
    cache = _cache(keep_empty_chunks=0)
    pinned = cache.ledger.snapshot().physical_bytes
    cache.close()
    cache = _cache(keep_empty_chunks=0, max_physical_bytes=pinned + (64 << 20))
    refused = 0
    for r in range(16):
        try:
            cache.admit(r, 8000)
            cache.extend(r, 2048)
        except PoolExhaustedError as err:
            assert err.pool == "physical"
            refused += 1
        assert cache.ledger.snapshot().physical_bytes <= pinned + (64 << 20)
        cache.check_integrity()
    assert refused
    cache.close()


def test_prefix_cache_under_the_cap_evicts_and_physical_stays_exact():
    """V4-Flash with the prefix cache under max_physical_bytes a quarter of the plan: requests one
    at a time, each second the next turn of the one before. The cache evicts for physical memory
    (before, prefills were refused once its pages filled the cap); every turn hits its whole
    prompt's pages; the drop of free GPU memory equals the ledger's physical bytes, within the cap."""
    pytest.importorskip("cuda.bindings")
    from lifecycle import serve_turns
    torch.zeros(1, device="cuda")
    base = _free_bytes()
    p = kvatlas.budget_for("deepseek-v4-flash", 16, 8192, chunked_prefill_tokens=2048, prefix_checkpoints=64)
    cap = p.total_bytes // 4
    cache = kvatlas.allocate(p, device="cuda", backend="vmm", max_physical_bytes=cap, keep_empty_chunks=2)

    def exact_within_the_cap(cache):
        assert base - _free_bytes() == cache.check_integrity().physical_bytes <= cap

    serve_turns(cache, 40, 4096, 300, 2048, seed=3, after=exact_within_the_cap)
    assert cache.prefix.stats.evicted_pages > 0
    cache.close()
