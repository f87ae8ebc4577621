"""The prefix cache with every layout, V4.1, pipeline and tensor parallel plans, and the vmm
backend (its in-memory stand-in driver): a repeated prompt hits, the ledger and the allocator
agree after every call, the rings of a hit start from the saved rows, evicted pages unmap."""

import numpy as np
import pytest
import torch

import kvatlas
from kvatlas.planning import formats
from kvatlas.vmm import StandInDriver, VmmBackend

V4 = [n for n, lay in formats.LAYOUTS.items() if lay.family == "v4"]
V41 = [n for n, lay in formats.LAYOUTS.items() if lay.family == "v4.1"]


def roundtrip(c, prompt=900, out=20):
    ids = np.random.default_rng(0).integers(0, 1000, prompt + out)
    hits = []
    for rid in ("a", "b"):
        adm = c.admit(rid, prompt, out, token_ids=ids[:prompt])
        hits.append(adm.cached_tokens)
        c.extend(rid, prompt - adm.cached_tokens)
        c.check_integrity()
        for _ in range(out):
            c.step([rid])
        c.check_integrity()
        c.finish(rid, token_ids=ids)
        c.check_integrity()
    return hits


@pytest.mark.parametrize("layout", V4)
def test_every_v4_layout(layout):
    memory = "128MiB" if layout == "fp64" else "64MiB"   # fp64 rows: 4,096 B an entry
    p = kvatlas.plan("tiny-v4", memory, max_model_len=2048, max_running_requests=2, prefix_checkpoints=4,
                     kv_layout=layout, chunked_prefill_tokens=1024)
    assert roundtrip(kvatlas.allocate(p)) == [0, 768]


@pytest.mark.parametrize("layout", V41)
def test_v41_window_layouts_save_window_rows(layout):
    p = kvatlas.plan("tiny-v4.1", "64MiB", max_model_len=2048, max_running_requests=2, prefix_checkpoints=4,
                     kv_layout=layout, chunked_prefill_tokens=1024)
    c = kvatlas.allocate(p)
    assert "ckpt.swa_window" in c.pools
    assert roundtrip(c) == [0, 768]


@pytest.mark.parametrize("opts", [dict(pp=2, pp_rank=0), dict(pp=2, pp_rank=1), dict(tp=2)])
def test_parallel_plans(opts):
    p = kvatlas.plan("tiny-v4", "64MiB", max_model_len=2048, max_running_requests=2, prefix_checkpoints=4,
                     chunked_prefill_tokens=1024, **opts)
    assert roundtrip(kvatlas.allocate(p)) == [0, 768]


def test_hit_rings_start_from_the_saved_rows():
    p = kvatlas.plan("tiny-v4", "64MiB", max_model_len=2048, max_running_requests=2, prefix_checkpoints=4,
                     chunked_prefill_tokens=1024)
    c = kvatlas.allocate(p)
    ids = np.arange(600)
    c.admit("a", 600, 1, token_ids=ids)
    w = c.extend("a", 512)
    c.flush()
    tok, rows = w.checkpoint_rows["ckpt.c4_state"]
    assert sorted(w.positions[tok] % 256) == [252, 252, 253, 253, 254, 254, 255, 255]   # 2 boundaries
    ckpt = c.pools["ckpt.c4_state"].tensor
    ckpt.view(-1, *ckpt.shape[2:])   # shape check: [units, layers, 4, width]
    for t, r in zip(tok.tolist(), rows.tolist()):
        ckpt[r // 4, :, r % 4] = float(w.positions[t])   # stand-in rows: their position
    c.extend("a", 88)
    c.finish("a", token_ids=ids)
    adm = c.admit("b", 600, 1, token_ids=ids)
    assert adm.cached_tokens == 512
    ring = c.pools["c4_state"].tensor[adm.request_slot]
    for pos in range(508, 512):
        assert torch.all(ring[:, pos % ring.shape[1]] == float(pos))
    assert torch.all(ring[:, 512 % ring.shape[1]][..., ring.shape[-1] // 2:] == float("-inf"))   # cleared


def test_vmm_backend_unmaps_evicted_pages():
    G = 64 << 10
    p = kvatlas.budget_for("tiny-v4", 2, 2048, prefix_checkpoints=2, chunked_prefill_tokens=1024)
    backend = VmmBackend(StandInDriver(granularity=G), keep_empty_chunks=0, chunk_bytes=G)
    c = kvatlas.allocate(p, backend=backend)
    rng = np.random.default_rng(1)
    for i in range(6):
        ids = rng.integers(0, 1000, 2000)
        c.admit(i, 2000, 40, token_ids=ids)
        for n in (1024, 976):
            c.extend(i, n)
        c.finish(i, token_ids=ids)
        c.check_integrity()
    assert c.prefix.stats.evicted_pages > 0
    before = c.ledger.snapshot().physical_bytes
    c.prefix.tree.evict_pages(len(c.prefix.tree.nodes))   # everything idle goes
    c.check_integrity()
    assert c.ledger.snapshot().physical_bytes < before
