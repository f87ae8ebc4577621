"""The bookkeeping backend ("none"): allocator and ledger without pool tensors. It must allocate
nothing, say so in every measure that counts memory, and keep exactly the same books as a cache
that holds real tensors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvatlas  # noqa: E402
from kvatlas.cli import main  # noqa: E402
from kvatlas.driving.sim import Simulator  # noqa: E402
from kvatlas.driving.workload import synthetic  # noqa: E402
from kvatlas.cache.arena import host_available_bytes  # noqa: E402
from kvatlas.errors import BudgetError  # noqa: E402

TINY = dict(max_running_requests=8, max_model_len=2048, chunked_prefill_tokens=512, draft_tokens=2)


def _allocator_state(cache) -> dict:
    a = cache.allocator
    return {k: v.copy() for k, v in vars(a).items() if isinstance(v, np.ndarray)}


def _books(snap) -> dict:
    """Everything a snapshot says except the memory it holds (tensor, reserved, physical, device)."""
    pools = {n: (p.units_used, p.entries_used, p.units_total, p.entries_total, p.measures.planned_bytes,
                 p.measures.addressable_bytes, p.measures.occupied_bytes) for n, p in snap.pools.items()}
    return {"pools": pools, "occupied": snap.occupied_bytes, "addressable": snap.addressable_bytes,
            "planned": snap.planned_bytes, "running": snap.running_requests,
            "refusals": snap.admission_refusals}


def test_no_tensor_memory_and_honest_measures():
    p = kvatlas.plan("tiny-v4", "96MiB", **TINY)
    cache = kvatlas.allocate(p, backend="none")
    assert all(r.tensor.is_meta for r in cache.arena.regions.values())
    assert all(pool.tensor.is_meta for pool in cache.pools.values())
    snap = cache.check_integrity()
    assert (snap.backend, snap.device) == ("none", "meta")
    assert snap.tensor_bytes == snap.reserved_bytes == snap.physical_bytes == 0
    assert snap.planned_bytes == p.total_bytes and snap.addressable_bytes == sum(b.addressable_bytes for b in p.buffers)
    for pool in snap.pools.values():
        m = pool.measures
        assert m.tensor_bytes == m.reserved_bytes == m.physical_bytes == 0 and m.planned_bytes > 0


def test_same_books_as_the_tensor_backed_cache_pass_by_pass():
    p = kvatlas.plan("tiny-v4", "96MiB", **TINY)
    reqs = synthetic(rate_per_s=40, duration_s=0.5, prompt="uniform:16:900", output="uniform:2:60", seed=5)
    real, books = kvatlas.allocate(p), kvatlas.allocate(p, backend="none")
    sims = [Simulator(c, reqs, seed=3) for c in (real, books)]
    t, passes = 0.0, 0
    while not sims[0].done:
        for sim in sims:
            sim.step(t)
        a, b = real.check_integrity(), books.check_integrity()
        assert _books(a) == _books(b), f"pass {passes}"
        sa, sb = _allocator_state(real), _allocator_state(books)
        assert sa.keys() == sb.keys() and all(np.array_equal(sa[k], sb[k]) for k in sa), f"pass {passes}"
        t += 0.02
        passes += 1
    assert sims[1].done and passes > 20
    assert dataclasses.asdict(sims[0].stats) == dataclasses.asdict(sims[1].stats)
    assert sims[0].stats.peak_occupied_bytes > 0 and sims[1].stats.finished == len(reqs)


def test_a_plan_larger_than_this_machine_runs_with_books_only():
    p = kvatlas.plan("deepseek-v4-flash", "120GiB")
    if host_available_bytes() < p.total_bytes:                # a real allocation is refused up front
        with pytest.raises(BudgetError, match="memory"):
            kvatlas.allocate(p, backend="plain")
    cache = kvatlas.allocate(p, backend="none")
    cache.admit("long", 100_000, 16)
    for start in range(0, 100_000, 8192):
        cache.extend("long", min(8192, 100_000 - start))
    snap = cache.check_integrity()
    assert snap.planned_bytes == 120 * 2**30 and snap.tensor_bytes == 0 and snap.occupied_bytes > 0
    cache.finish("long")
    assert cache.check_integrity().occupied_bytes == 0


def test_simulate_says_plainly_that_nothing_is_allocated(tmp_path, capsys):
    args = ["simulate", "tiny-v4", "--memory", "96MiB", "--max-running-requests", "8", "--max-model-len", "2048",
            "--chunked-prefill-tokens", "512", "--rate", "20", "--duration", "0.3", "--backend", "none",
            "--no-plot", "--out", str(tmp_path / "run")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "NO POOL TENSORS (backend none)" in out and "0 B allocated" in out
    assert main(args + ["--write-layers", "1"]) == 2
    assert "--write-layers" in capsys.readouterr().err
