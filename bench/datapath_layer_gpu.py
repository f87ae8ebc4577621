"""Per-layer writes and reads as an engine issues them (issue 15): one call per layer, captured in
CUDA graphs, against a per-layer device copy of the same bytes measured in the same run.

    python bench/datapath_layer_gpu.py [--json FILE] [--tune]

A V4-Flash cache (kvatlas.plan + allocate, fp8_ds_mla, fp8 indexer, fp32 rings) with 1,024 running
requests at random lengths; the step's indices come from the allocator (`cache.step`). Cases:
- decode write: `write_layer` for the 43 main layers (SWA entry, C4/C128 ring append, completed
  compressed entries and indexer keys), one launch per layer;
- SWA store alone (`store`, one layer per call) and SWA gather (`gather`, one layer per call);
- prefill: one 8,192-token chunk of one request, one layer: SWA store; C4 and C128 layer writes
  (two launches each: pooling, then the ring append).
Bytes counted per layer: inputs read once (bf16 SWA rows, kv/score rows), entries written (data +
scale bytes), ring rows written (tokens kept) and ring rows read by pooling (window rows older
than the step: half a C4 row, a whole C128 row). The copy baseline moves the same count (it reads
and writes half each), one copy_ per layer into buffers of its own. `--tune` sweeps the launch
configurations of the fused write first (each printed; the figures use the best). Before timing,
one layer of each kind is written by Triton and by the torch reference from the same state, and
the bytes are compared.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kvatlas  # noqa: E402
from datapath_gpu import bench  # noqa: E402
from kvatlas.datapath import LayerTargets, StepIndices, gather, store, write_layer  # noqa: E402
from kvatlas.datapath.kernels import codec_triton, write_triton  # noqa: E402

REQUESTS, MAIN_LAYERS, CHUNK = 1024, 43, 8192


def flash_cache():
    plan = kvatlas.budget_for("deepseek-v4-flash", REQUESTS + 1, 8192, chunked_prefill_tokens=CHUNK)
    cache = kvatlas.allocate(plan, device="cuda")
    rng = np.random.default_rng(0)
    for i, prompt in enumerate(rng.integers(1, 4000, REQUESTS)):
        cache.admit(i, int(prompt), 64)
        for start in range(0, int(prompt), CHUNK):
            cache.extend(i, min(CHUNK, int(prompt) - start))
    return cache


def layer_inputs(n, t: LayerTargets, seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {"swa_kv": torch.randn(n, 512, device="cuda", generator=g).bfloat16()}
    for key, ring in (("", t.kv), ("index_", t.index)):
        if ring is not None:
            cd = ring.spec.coff * ring.spec.head_dim
            out[key + "kv"] = torch.randn(n, cd, device="cuda", generator=g).bfloat16()
            out[key + "score"] = (torch.randn(n, cd, device="cuda", generator=g) * 3).bfloat16()
    return out


def moved_bytes(w, t: LayerTargets, x: dict) -> int:
    """Bytes one layer's write must at least read and write (see the module docstring)."""
    total = sum(v.numel() * v.element_size() for v in x.values())
    fmt = t.swa.geom.fmt
    total += w.num_tokens * (fmt.data_bytes + fmt.scale_bytes)
    pos, rs = np.asarray(w.positions), np.asarray(w.request_slots)
    starts = np.flatnonzero(np.r_[True, rs[1:] != rs[:-1]])
    first = pos[starts][np.cumsum(np.r_[True, rs[1:] != rs[:-1]]) - 1]
    last = pos[np.r_[starts[1:] - 1, len(pos) - 1]][np.cumsum(np.r_[True, rs[1:] != rs[:-1]]) - 1]
    for ring in (t.kv, t.index):
        if ring is None:
            continue
        spec, item = ring.spec, ring.state.element_size()
        kept = int(np.count_nonzero(pos > last - ring.state.shape[2]))
        total += kept * spec.width * item
        done = (pos + 1) % ring.ratio == 0
        q = pos[done][:, None] - spec.window + 1 + np.arange(spec.window)
        from_ring = int(np.count_nonzero((q >= 0) & (q < first[done][:, None])))
        total += from_ring * 2 * spec.head_dim * item
        f = ring.pool.geom.fmt
        total += int(done.sum()) * (f.data_bytes + f.scale_bytes)
    return total


def copies(sizes):
    """One copy_ per layer of the given byte counts (each moves its size: half read, half written)."""
    bufs = [(torch.empty(max(b // 2, 1), dtype=torch.uint8, device="cuda"),
             torch.empty(max(b // 2, 1), dtype=torch.uint8, device="cuda")) for b in sizes]

    def fn():
        for src, dst in bufs:
            dst.copy_(src)
    return bench(fn)


def layer_views(t: LayerTargets):
    out = [t.swa.buffer[:, t.swa.layer]]
    for ring in (t.kv, t.index):
        if ring is not None:
            out += [ring.state[:, ring.layer], ring.pool.buffer[:, ring.pool.layer]]
    return out


def spot_check(step, t: LayerTargets, x) -> None:
    """Triton and the torch reference from the same state write the same bytes (one layer)."""
    views = layer_views(t)
    before = [v.clone() for v in views]
    write_layer(step, t, impl="triton", **x)
    got = [v.clone() for v in views]
    for v, b in zip(views, before):
        v.copy_(b)
    write_layer(step, t, impl="torch", **x)
    for v, g in zip(views, got):
        assert torch.equal(v.view(torch.uint8), g.view(torch.uint8)), "Triton write differs from the reference"
    del before, got


def row(rows, case, t_op, t_copy, moved):
    rows.append({"case": case, "us": t_op * 1e6, "copy_us": t_copy * 1e6, "vs_copy": t_op / t_copy,
                 "bytes": moved, "gbps": moved / t_op / 1e9, "copy_gbps": moved / t_copy / 1e9})
    r = rows[-1]
    print(f"{case:58} {r['us']:9.1f} {r['copy_us']:9.1f} {r['vs_copy']:7.2f} {r['gbps']:8.0f}", flush=True)


def decode_cases(rows, cache, tune: bool) -> None:
    batch = cache.batch(list(range(REQUESTS)))
    w = cache.step(batch)
    step = StepIndices.of(w, "cuda", ratios=(4, 128))
    layers = range(MAIN_LAYERS)
    tg = {l: LayerTargets.of_cache(cache, l) for l in layers}
    xs = {l: layer_inputs(w.num_tokens, tg[l], l) for l in layers}
    for l in (0, 2, 3):                              # SWA-only, C4, C128 layers of V4-Flash
        spot_check(step, tg[l], xs[l])
    sizes = [moved_bytes(w, tg[l], xs[l]) for l in layers]

    def write_all(sel=layers):
        for l in sel:
            write_layer(step, tg[l], validate=False, **xs[l])
    if tune:
        tune_write(write_all)
    row(rows, "decode write, 1024 req, 43 layers (1 launch each)", bench(write_all), copies(sizes), sum(sizes))
    for kind, sel in (("C4", [l for l in layers if tg[l].index is not None]),
                      ("C128", [l for l in layers if tg[l].kv is not None and tg[l].index is None])):
        row(rows, f"  of which the {len(sel)} {kind} layers", bench(lambda: write_all(sel)),
            copies([sizes[l] for l in sel]), sum(sizes[l] for l in sel))
    swa_cases(rows, cache, w, tg, xs)


def tune_write(fn) -> None:
    """Over the whole decode step, one group of knobs at a time: tokens per token program of the C4
    layers; 64-channel tiles per C4 KV work item; tokens per token program and warps of the C128
    layers' launches, together."""
    groups = ([dict(swa_bt=b) for b in (1, 2, 4)], [dict(c4_tpi=t) for t in (2, 4)],
              [dict(c128_bt=b, c128_warps=w) for w in (4, 8) for b in (2, 4, 8)])
    for group in groups:
        best = None
        for knobs in group:
            write_triton.CONFIG.update(knobs)
            t = bench(fn)
            print(f"tune write {knobs}: {t * 1e6:.1f} us", flush=True)
            best = min(best or (t, str(knobs), knobs), (t, str(knobs), knobs))
        write_triton.CONFIG.update(best[2])


def swa_cases(rows, cache, w, tg, xs) -> None:
    s = tg[0].swa
    slots = torch.as_tensor(w.swa_slots, device="cuda")
    fmt = s.geom.fmt
    per = w.num_tokens * (1024 + fmt.data_bytes + fmt.scale_bytes)
    sizes = [per] * MAIN_LAYERS
    swa_only = {l: LayerTargets(swa=tg[l].swa) for l in range(MAIN_LAYERS)}
    step = StepIndices.of(w, "cuda", ratios=(4, 128))

    def st():
        for l in range(MAIN_LAYERS):
            store(s.geom, s.buffer, l, slots, xs[l]["swa_kv"], validate=False)

    def wl():
        for l in range(MAIN_LAYERS):
            write_layer(step, swa_only[l], validate=False, swa_kv=xs[l]["swa_kv"])

    def ga():
        for l in range(MAIN_LAYERS):
            gather(s.geom, s.buffer, l, slots, validate=False)
    t_copy = copies(sizes)
    row(rows, "SWA store alone, 1024 req, 43 layers (store per layer)", bench(st), t_copy, sum(sizes))
    row(rows, "SWA store alone, 1024 req, 43 layers (write_layer)", bench(wl), t_copy, sum(sizes))
    row(rows, "SWA gather, 1024 req, 43 layers (gather per layer)", bench(ga), t_copy, sum(sizes))


def prefill_cases(rows, cache) -> None:
    cache.admit("long", CHUNK, 0)
    w = cache.extend("long", CHUNK)
    step = StepIndices.of(w, "cuda", ratios=(4, 128))
    for layer, name in ((0, "SWA store (write_layer)"), (2, "C4 layer write"), (3, "C128 layer write")):
        t = LayerTargets.of_cache(cache, layer) if layer else LayerTargets(swa=LayerTargets.of_cache(cache, 0).swa)
        x = layer_inputs(CHUNK, t, layer)
        spot_check(step, t, x)
        moved = moved_bytes(w, t, x)
        row(rows, f"prefill chunk {CHUNK} tokens, one layer: {name}",
            bench(lambda: write_layer(step, t, validate=False, **x)), copies([moved]), moved)


def main(json_path: str | None, tune: bool) -> None:
    rows: list[dict] = []
    print(f"{'case':58} {'us':>9} {'copy us':>9} {'x copy':>7} {'GB/s':>8}")
    cache = flash_cache()
    decode_cases(rows, cache, tune)
    prefill_cases(rows, cache)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
           "write_config": dict(write_triton.CONFIG), "one_layer_config": dict(codec_triton.CONFIG_ONE_LAYER)}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    ap.add_argument("--tune", action="store_true", help="sweep launch configurations first")
    a = ap.parse_args()
    main(a.json, a.tune)
