"""Pick tokens-per-program and warps for the Triton store/gather kernels on this GPU, then run
bench/datapath_gpu.py with the best settings in the same process.

    python bench/datapath_tune.py        (prints the grid; the best goes into codec_triton.CONFIG)
"""

from __future__ import annotations

import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import datapath_gpu as dg  # noqa: E402
from kvatlas import formats  # noqa: E402
from kvatlas.datapath import gather, store  # noqa: E402
from kvatlas.datapath.kernels import codec_triton as ct  # noqa: E402

GRID = list(itertools.product((2, 4, 8, 16, 32), (2, 4, 8)))


def cases():
    fmt = formats.FP8_DS_MLA
    geom, buf = dg.pool(fmt, dg.SWA_PAGE, dg.FLASH_LAYERS, 3 * dg.DECODE + 1)
    slots = dg.decode_slots(dg.DECODE, dg.SWA_PAGE)
    x = torch.randn(dg.FLASH_LAYERS, dg.DECODE, 512, device="cuda").bfloat16()
    yield "ds_mla", fmt, geom, buf, range(0, dg.FLASH_LAYERS), slots, x
    ifmt = formats.INDEXER_FORMATS["fp8"]
    igeom, ibuf = dg.pool(ifmt, dg.INDEX_PAGE, dg.FLASH_C4_LAYERS, 2 * dg.DECODE + 1)
    islots = dg.decode_slots(dg.DECODE, dg.INDEX_PAGE, 2)
    ix = torch.randn(dg.FLASH_C4_LAYERS, dg.DECODE, 128, device="cuda").bfloat16()
    yield "index", ifmt, igeom, ibuf, range(0, dg.FLASH_C4_LAYERS), islots, ix


def tune(best, kind, fmt, geom, buf, layers, slots, x) -> None:
    """Time every (tokens per program, warps) for this case's store and gather; keep the best."""
    moved = dg.moved_bytes(fmt, layers, slots, x)
    copy = dg.copy_seconds(moved)
    for op in ("store", "gather"):
        key = f"{kind}_{op}"
        results = []
        for bt, warps in GRID:
            ct.CONFIG[key] = (bt, warps)
            dg.check(geom, buf, layers, slots, x)
            fn = (lambda: store(geom, buf, layers, slots, x, validate=False)) if op == "store" \
                else (lambda: gather(geom, buf, layers, slots, validate=False))
            t = dg.bench(fn)
            results.append((t, bt, warps))
            print(f"{key:15} BT={bt:2d} warps={warps}  {t * 1e6:8.1f} us  vs copy {copy / t:5.2f}")
        t, bt, warps = min(results)
        best[key] = ct.CONFIG[key] = (bt, warps)


def main() -> None:
    best: dict = {}
    for case in cases():
        tune(best, *case)
        del case                 # the pool buffer (GBs) goes before the next case is built
        torch.cuda.empty_cache()
    print("best CONFIG =", best)
    dg.main()


if __name__ == "__main__":
    main()
