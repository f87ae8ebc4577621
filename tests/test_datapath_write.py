"""write_layer's reference path against today's calls (store + compress_batch), byte for byte,
for every V4 layout, indexer format and state dtype; and its refusals."""

import numpy as np
import pytest
import torch

import kvatlas

from kvatlas.datapath import (DataPathError, LayerTargets, StepIndices, compress_batch, compressed_slots,
                              store, write_layer)

from write_steps import assert_same, clones, inputs, make_cache, run, schedule, targets

CASES = [dict(), dict(kv_layout="unified-fp8", indexer="fp4"),
         dict(kv_layout="bf16", indexer="bf16", state_dtype="bf16"),
         dict(kv_layout="uniform-fp8", draft_tokens=2), dict(kv_layout="unified-bf16")]


def today(cache, tensors, w, layer, x, t):
    """One layer's writes with the calls that existed before write_layer, entries placed through
    the block table (not the allocator's entry indices)."""
    dev = cache.device
    s = t.swa
    store(s.geom, s.buffer, s.layer, torch.as_tensor(w.swa_slots, device=dev), x["swa_kv"], parallel=s.parallel,
          impl="torch")
    req, pos = torch.as_tensor(w.request_slots, device=dev), torch.as_tensor(w.positions, device=dev)
    table = torch.as_tensor(cache.allocator.full_table, device=dev)
    for key, ring in (("", t.kv), ("index_", t.index)):
        if ring is None:
            continue
        b = compress_batch(ring.state, ring.layer, req, pos, x[key + "kv"], x[key + "score"], ratio=ring.ratio,
                           ape=ring.ape, impl="torch")
        p = ring.pool
        slots = compressed_slots(table, b.req_slots, b.block_ids, p.geom.entries)
        store(p.geom, p.buffer, p.layer, slots, b.entries, parallel=p.parallel, impl="torch")


@pytest.mark.parametrize("options", CASES, ids=lambda o: "-".join(f"{v}" for v in o.values()) or "v4")
def test_reference_path_equals_todays_calls(options):
    cache = make_cache(**options)
    ref = clones(cache)
    rt = targets(cache, ref)
    tt = targets(cache)
    wrote = {4: 0, 128: 0}
    for s, w in enumerate(schedule(cache, options.get("draft_tokens", 0))):
        step = StepIndices.of(w, "cpu", ratios=(4, 128))
        for r in wrote:
            wrote[r] += int(np.count_nonzero(w.compressed[r][0]))
        for layer, t in tt.items():
            x = inputs(w.num_tokens, t, 1000 * s + layer, "cpu")
            write_layer(step, t, impl="torch", **x)
            today(cache, ref, w, layer, x, rt[layer])
    assert wrote[4] > 0 and wrote[128] > 0          # the run completes blocks of both ratios
    assert_same(cache, ref)
    assert any(bool(v.view(torch.uint8).any()) for k, v in ref.items() if k.startswith("c128_kv"))


def test_auto_on_cpu_is_the_reference():
    cache = make_cache()
    ref = clones(cache)
    run(cache, ref, schedule(cache), impl="auto")
    assert_same(cache, ref)


def test_refusals_name_the_field():
    cache = make_cache()
    t = targets(cache)[1]
    w = cache.step(["a", "b", "c"])
    step = StepIndices.of(w, "cpu")
    x = inputs(3, t, 0, "cpu")
    with pytest.raises(DataPathError, match="index_kv"):
        write_layer(step, t, **{k: v for k, v in x.items() if k != "index_kv"})
    with pytest.raises(DataPathError, match="swa_kv"):
        write_layer(step, t, **(x | {"swa_kv": x["swa_kv"][:2]}))
    with pytest.raises(DataPathError, match="impl"):
        write_layer(step, t, impl="triton", **x)
    with pytest.raises(DataPathError, match="indices"):
        StepIndices(5, "cpu").load(w)
    with pytest.raises(DataPathError, match="ratio"):
        write_layer(StepIndices.of(w, "cpu", ratios=(128,)), t, **x)
    with pytest.raises(DataPathError, match="ape"):
        LayerTargets.of_cache(cache, 1, ape=torch.zeros(4, 512))
    v41 = kvatlas.allocate(kvatlas.budget_for("tiny-v4.1", 2, 4096, chunked_prefill_tokens=512))
    with pytest.raises(DataPathError, match="V4.1"):
        LayerTargets.of_cache(v41, 1)
