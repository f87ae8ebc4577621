"""VMM bookkeeping pieces on CPU: the layout's chunk arithmetic, lowest-first placement, the
backend's errors. The driver here is the in-memory STAND-IN (kvatlas.vmm.standin), not CUDA."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import kvatlas  # noqa: E402
from kvatlas.alloc.allocator import Allocator  # noqa: E402
from kvatlas.alloc.freelist import FreeList  # noqa: E402
from kvatlas.alloc.lowest import LowestFreeList  # noqa: E402
from kvatlas.cli import main  # noqa: E402
from kvatlas.errors import ConfigError  # noqa: E402
from kvatlas.units import MIB, round_up  # noqa: E402
from kvatlas.vmm import ChunkLayout, StandInDriver, VmmBackend, chunks_per_unit  # noqa: E402
from kvatlas.vmm.layout import chunks_per_unit_max  # noqa: E402

G = 2 * MIB


def flash_120():
    return kvatlas.plan("deepseek-v4-flash", "120GiB")


def test_unit_major_layout_numbers_v4_flash():
    p = flash_120()
    pools = p.pools()
    swa = chunks_per_unit(pools["swa_kv"], G)
    full = chunks_per_unit([s for s in p.buffers if s.group == "full_pages"], G)
    assert pools["swa_kv"][0].unit_bytes == 43 * 37_440 == 1_609_920
    assert [s.unit_bytes for s in p.buffers if s.group == "full_pages"] == [786_240, 177_408, 34_560]
    assert swa["max"] == 2 and swa["layer_major_min"] == 43
    assert full["max"] == 6 and full["layer_major_min"] == 62
    assert round(swa["mean"], 2) == 1.77 and round(full["mean"], 2) == 3.48


def test_chunks_of_matches_brute_force():
    p = kvatlas.budget_for("tiny-v4", 4, 2048, chunked_prefill_tokens=300)
    g = 64 << 10
    layout = ChunkLayout(p.buffers, g)
    for placed in layout.placed:
        assert placed.offset_bytes % g == 0
    assert layout.reserved_bytes == sum(round_up(b.bytes, g) for b in p.buffers)
    assert set(layout.tables) == {"full_pages", "swa_pages", "request_slots"}
    for group in layout.tables:
        bufs = [layout.by_name[b.name] for b in p.buffers if b.group == group and b.role != "table"]
        ids = np.arange(1, bufs[0].spec.units)
        got = layout.chunks_of(group, ids)
        want = []
        for placed in bufs:
            ub = placed.spec.unit_bytes
            for i in ids.tolist():
                want += range(placed.first_chunk + i * ub // g, placed.first_chunk + ((i + 1) * ub - 1) // g + 1)
        assert sorted(got[got != layout.sentinel].tolist()) == sorted(want)


@given(st.integers(1, 5 * G), st.integers(0, G - 1))
def test_max_chunks_per_unit_is_a_bound(unit_bytes, start):
    touched = (start + unit_bytes - 1) // G - start // G + 1
    assert touched <= chunks_per_unit_max(unit_bytes, G)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=80), st.integers(2, 700))
def test_lowest_free_list_pops_the_lowest_ids(ops, units):
    fl = LowestFreeList(units)
    free = set(range(1, units))
    live: list[int] = []
    for is_pop, n in ops:
        if is_pop:
            n = min(n, len(free))
            assert fl.peek(n).tolist() == sorted(free)[:n]
            ids = fl.pop(n, 0)
            assert ids.tolist() == sorted(free)[:n]
            free -= set(ids.tolist())
            live += ids.tolist()
        elif live:
            back, live = live[: n % (len(live) + 1)], live[n % (len(live) + 1):]
            fl.push(np.array(back, np.int64))
            free |= set(back)
        assert fl.free == len(free) and fl.check("t") == []


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 600)), max_size=60), st.integers(0, 2**32 - 1))
def test_lowest_free_list_large_batches(ops, seed):
    """Pushes big enough to merge the recent ids into the holes, and to give the top back."""
    rng = np.random.default_rng(seed)
    fl = LowestFreeList(3000)
    free, live = set(range(1, 3000)), []
    for is_pop, n in ops:
        if is_pop:
            n = min(n, len(free))
            ids = fl.pop(n, 0)
            assert ids.tolist() == sorted(free)[:n]
            free -= set(ids.tolist())
            live += ids.tolist()
        elif live:
            rng.shuffle(live)
            back, live = live[: n % (len(live) + 1)], live[n % (len(live) + 1):]
            fl.push(np.array(back, np.int64))
            free |= set(back)
        assert fl.free == len(free) and fl.check("t") == []
        assert set(np.flatnonzero(fl.is_free).tolist()) == free


def test_plain_backend_keeps_the_lifo_path():
    cache = kvatlas.allocate(kvatlas.plan("tiny-v4", "64MiB", max_running_requests=3, max_model_len=4096))
    a = cache.allocator
    assert a.backing is None and type(a.slots) is FreeList and type(a.full) is FreeList
    assert isinstance(Allocator(cache.plan).swa, FreeList)


def test_without_cuda_the_vmm_backend_says_what_to_do(capsys):
    p = kvatlas.plan("tiny-v4", "64MiB", max_running_requests=3, max_model_len=4096)
    with pytest.raises(ConfigError) as err:
        kvatlas.allocate(p, backend="vmm")
    msg = str(err.value)
    assert "CUDA" in msg and "cuda-python" in msg and "plain" in msg
    assert main(["alloc", "tiny-v4", "--memory", "1GiB", "--backend", "vmm"]) == 2
    assert "cuda-python" in capsys.readouterr().err


def test_backend_options_are_checked():
    p = kvatlas.plan("tiny-v4", "64MiB", max_running_requests=3, max_model_len=4096)
    with pytest.raises(ConfigError, match="max_physical_bytes"):
        kvatlas.allocate(p, backend="plain", max_physical_bytes="1GiB")
    with pytest.raises(ConfigError, match="keep_empty_chunks"):
        VmmBackend(StandInDriver(), keep_empty_chunks=-1)
    with pytest.raises(ConfigError, match="max_physical_bytes"):   # below what must stay mapped
        kvatlas.allocate(p, backend=VmmBackend(StandInDriver(granularity=64 << 10), max_physical_bytes=1024))


def test_chunk_bytes_option():
    p = kvatlas.budget_for("tiny-v4", 4, 2048, chunked_prefill_tokens=300)
    g = 64 << 10
    with pytest.raises(ConfigError, match="chunk_bytes"):
        VmmBackend(StandInDriver(granularity=g), chunk_bytes="96KiB")            # not a power of two
    with pytest.raises(ConfigError, match="chunk_bytes"):
        kvatlas.allocate(p, backend=VmmBackend(StandInDriver(granularity=g), chunk_bytes="32KiB"))  # < granularity
    fine = kvatlas.allocate(p, backend=VmmBackend(StandInDriver(granularity=g), chunk_bytes=g))
    coarse = kvatlas.allocate(p, backend=VmmBackend(StandInDriver(granularity=g), chunk_bytes=4 * g))
    for cache in (fine, coarse):
        cache.admit("a", 600)
        cache.extend("a", 300)
        cache.check_integrity()
    cm_f, cm_c = fine.arena.backend.chunks, coarse.arena.backend.chunks
    assert cm_c.G == 4 * g and cm_c.layout.granularity == 4 * g
    driver = coarse.arena.backend.driver
    assert driver.mapped_bytes == cm_c.num_mapped * 4 * g == coarse.ledger.snapshot().physical_bytes
    assert all(off % (4 * g) == 0 for off in driver.mapped_offsets())       # one 4g map per chunk
    assert cm_c.map_calls < cm_f.map_calls
    assert coarse.ledger.snapshot().physical_bytes >= fine.ledger.snapshot().physical_bytes
    fine.close()
    coarse.close()


def test_stand_in_ledger_measures():
    p = kvatlas.budget_for("tiny-v4", 4, 2048, chunked_prefill_tokens=300)
    g = 64 << 10
    cache = kvatlas.allocate(p, backend=VmmBackend(StandInDriver(granularity=g), chunk_bytes=g))
    snap = cache.check_integrity()
    backend = cache.arena.backend
    assert snap.backend == "vmm"
    assert snap.tensor_bytes == snap.planned_bytes == p.total_bytes
    assert snap.reserved_bytes == sum(round_up(b.bytes, g) for b in p.buffers)
    assert snap.physical_bytes == backend.chunks.num_mapped * g == backend.driver.mapped_bytes
    assert snap.physical_bytes < snap.tensor_bytes
    assert sum(u.measures.physical_bytes for u in snap.pools.values()) == snap.physical_bytes
    assert sum(u.measures.reserved_bytes for u in snap.pools.values()) == snap.reserved_bytes
    assert torch.count_nonzero(cache.pools["c4_kv"].tensor[0]) == 0        # null page mapped, zeroed
    assert torch.count_nonzero(cache.pools["block_table"].tables["full"]) == 0
    cache.admit("a", 600)
    cache.extend("a", 300)
    grown = cache.check_integrity().physical_bytes
    assert grown > snap.physical_bytes
    cache.finish("a")
    backend.trim()
    assert cache.check_integrity().physical_bytes == snap.physical_bytes   # back to the pinned set
    cache.close()
    assert backend.driver.memory is None


def test_default_chunk_is_four_granules():
    # measured on an H200: 8 MiB chunks (4 × 2 MiB) kept a growing decode step within 1.10× of
    # the plain backend where 2 MiB chunks did not, at the same physical footprint
    g = 64 << 10
    p = kvatlas.budget_for("tiny-v4", 2, 1024, chunked_prefill_tokens=256)
    cache = kvatlas.allocate(p, backend=VmmBackend(StandInDriver(granularity=g)))
    assert cache.arena.backend.layout.granularity == 4 * g
