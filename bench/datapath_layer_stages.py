"""Where the time of the fused per-layer write goes (issue 15): the decode step of
datapath_layer_gpu.py, its C4 and C128 layers launched with one stage left out at a time, in CUDA
graphs, against a copy of the layers' bytes in the same run.

    python bench/datapath_layer_stages.py [--json FILE]
    ncu --clock-control none -k regex:_write_layer --launch-skip 1 --launch-count 3 \\
        python bench/datapath_layer_stages.py --ncu      # launches: C4, C4, C128, C128

Stages: token programs only (SWA store + ring appends), SWA store only, ring appends only, pool
programs only (completed entries), and on C4 layers pool programs with the KV items only or the
indexer items only. The stage launches write what their stage writes, nothing else.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import datapath_layer_gpu as layer_bench  # noqa: E402
from datapath_gpu import bench  # noqa: E402
from kvatlas.datapath import LayerTargets, StepIndices, write_layer  # noqa: E402
from kvatlas.datapath.kernels import write_triton  # noqa: E402
from kvatlas.datapath.write import _rings  # noqa: E402

STAGES = {   # name: (token programs?, pool programs?, SWA store, ring appends, constants changed)
    "tokens only (SWA store + ring appends)": (True, False, 1, 1, {}),
    "SWA store only": (True, False, 1, 0, {}),
    "ring appends only": (True, False, 0, 1, {}),
    "pool programs only": (False, True, 0, 0, {}),
    "pool programs, KV items only": (False, True, 0, 0, {"HAS_IDX": False}),
    "pool programs, indexer items only": (False, True, 0, 0, {"HAS_CMP": False}),
}


def decode_step():
    cache = layer_bench.flash_cache()
    w = cache.step(cache.batch(list(range(layer_bench.REQUESTS))))
    step = StepIndices.of(w, "cuda", ratios=(4, 128))
    tg = {l: LayerTargets.of_cache(cache, l) for l in range(layer_bench.MAIN_LAYERS)}
    xs = {l: layer_bench.layer_inputs(w.num_tokens, tg[l], l) for l in tg}
    sizes = {l: layer_bench.moved_bytes(w, tg[l], xs[l]) for l in tg}
    return step, tg, xs, sizes


def stage_fn(step, tg, xs, sel, stage):
    tokens, pools, swa, app, cover = STAGES[stage]
    plans = {l: write_triton.launch_plan(step, tg[l], xs[l]["swa_kv"], _rings(
        tg[l], xs[l].get("kv"), xs[l].get("score"), xs[l].get("index_kv"), xs[l].get("index_score"))) for l in sel}

    def fn():
        for head, args, const, tok, pool, _ in plans.values():
            write_triton.launch(head, args, {**const, **cover}, tok if tokens else 0, pool if pools else 0, swa, app)
    return fn


def main(json_path: str | None, ncu: bool) -> None:
    step, tg, xs, sizes = decode_step()
    if ncu:
        for l in (2, 2, 3, 3):   # a C4 layer and a C128 layer of V4-Flash, twice each
            write_layer(step, tg[l], validate=False, **xs[l])
        torch.cuda.synchronize()
        return
    rows = []
    kinds = (("C4", [l for l in tg if tg[l].index is not None]),
             ("C128", [l for l in tg if tg[l].kv is not None and tg[l].index is None]))
    for kind, sel in kinds:
        t_copy = layer_bench.copies([sizes[l] for l in sel])
        cases = {"whole write": lambda: [write_layer(step, tg[l], validate=False, **xs[l]) for l in sel]}
        cases |= {s: stage_fn(step, tg, xs, sel, s) for s in STAGES if kind == "C4" or "items only" not in s}
        for name, fn in cases.items():
            t = bench(fn)
            rows.append({"layers": kind, "case": name, "us": t * 1e6, "copy_us": t_copy * 1e6})
            print(f"{kind:5} {name:42} {t * 1e6:8.1f} us   copy {t_copy * 1e6:8.1f} us", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "config": dict(write_triton.CONFIG), "rows": rows}, f,
                      indent=2)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    ap.add_argument("--ncu", action="store_true", help="only launch two C4 and two C128 layer writes (for ncu)")
    a = ap.parse_args()
    main(a.json, a.ncu)
