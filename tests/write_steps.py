"""Steps of a small V4 cache for the write_layer tests: the allocator's real WriteIndices, random
layer inputs, and a reference copy of every pool tensor (CPU tests, interpreter, GPU test)."""

from __future__ import annotations

import numpy as np
import torch

import kvatlas
from kvatlas.alloc import WriteIndices
from kvatlas.datapath import LayerTargets, StepIndices, write_layer

REQUESTS = ("a", "b", "c")


def make_cache(device="cpu", **options):
    opts = dict(chunked_prefill_tokens=512, max_model_len=4096) | options
    plan = kvatlas.budget_for("tiny-v4", len(REQUESTS), opts.pop("max_model_len"), **opts)
    cache = kvatlas.allocate(plan, device=device)
    for rid, prompt in zip(REQUESTS, (300, 150, 9)):
        cache.admit(rid, prompt, 64)
    return cache


def clones(cache) -> dict:
    """A copy of every pool tensor (and unified rope buffer), for the reference to write into."""
    out = {}
    for name, pool in cache.pools.items():
        if pool.spec.role == "table":
            continue
        out[name] = pool.tensor.clone()
        if getattr(pool, "rope", None) is not None:
            out[name + ".rope"] = pool.rope.clone()
    return out


def apes(cache, seed=0):
    g = torch.Generator().manual_seed(seed)
    dev = cache.device
    return (torch.randn(4, 1024, generator=g).to(dev), torch.randn(128, 512, generator=g).to(dev),
            torch.randn(4, 256, generator=g).to(dev))


def targets(cache, tensors=None, with_ape=True):
    """LayerTargets of every layer (the ape of a layer follows its ratio)."""
    a4, a128, ai = apes(cache) if with_ape else (None, None, None)
    out = {}
    for layer in cache.pools["swa_kv"].layers:
        pools = cache.layer_pools(layer)
        ape = a4 if "c4_kv" in pools else a128 if "c128_kv" in pools else None
        out[layer] = LayerTargets.of_cache(cache, layer, ape=ape, index_ape=ai if "c4_kv" in pools else None,
                                           tensors=tensors)
    return out


def inputs(n, t: LayerTargets, seed: int, device, dtype=torch.bfloat16) -> dict:
    """Random inputs of one layer for n tokens (scores spread, so the softmax is not flat)."""
    g = torch.Generator().manual_seed(seed)
    out = {"swa_kv": (torch.randn(n, 512, generator=g) * 2).to(dtype)}
    for key, ring in (("", t.kv), ("index_", t.index)):
        if ring is not None:
            cd = ring.spec.coff * ring.spec.head_dim
            out[key + "kv"] = torch.randn(n, cd, generator=g).to(dtype)
            out[key + "score"] = (torch.randn(n, cd, generator=g) * 3).to(dtype)
    return {k: v.to(device) for k, v in out.items()}


def concat(*ws):
    """The indices of several extend() calls of one forward pass, as one step's tokens."""
    cat = lambda f: np.concatenate([getattr(w, f) for w in ws])
    return WriteIndices(request_slots=cat("request_slots"), positions=cat("positions"), swa_slots=cat("swa_slots"),
                        full_slots=cat("full_slots"), workspace_rows=cat("workspace_rows"),
                        compressed={r: tuple(np.concatenate([w.compressed[r][i] for w in ws]) for i in (0, 1))
                                    for r in ws[0].compressed},
                        state_rows={k: np.concatenate([w.state_rows[k] for w in ws]) for k in ws[0].state_rows})


def schedule(cache, draft_tokens=0):
    """The allocator calls of a short run: chunked prefills of different lengths, a mixed batch,
    then decode steps (with drafts, 1 + draft_tokens tokens each)."""
    yield cache.extend("a", 150)
    yield cache.extend("a", 140)
    with cache.allocator.forward():     # one forward pass: two requests' chunks in one write
        yield concat(cache.extend("b", 140), cache.extend("c", 9))
    for _ in range(3):
        yield cache.step(list(REQUESTS), 1 + draft_tokens)


def run(cache, tensors, steps, impl, ref_impl="torch", seed=0):
    """Write every layer of every step twice: `impl` into the cache, `ref_impl` into `tensors`."""
    tt, rt = targets(cache), targets(cache, tensors)
    for s, w in enumerate(steps):
        step = StepIndices.of(w, cache.device, ratios=(4, 128))
        for layer, t in tt.items():
            x = inputs(w.num_tokens, t, seed + 1000 * s + layer, cache.device)
            write_layer(step, t, impl=impl, **x)
            write_layer(step, rt[layer], impl=ref_impl, **x)


def assert_same(cache, tensors):
    for name, want in tensors.items():
        pool = cache.pools[name.removesuffix(".rope")]
        got = pool.rope if name.endswith(".rope") else pool.tensor
        bad = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero()
        assert bad.numel() == 0, f"{name}: {bad.shape[0]} bytes differ, first at {bad[:3].tolist()}"
