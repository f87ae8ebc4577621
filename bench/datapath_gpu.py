"""Data-path throughput on one GPU (issue 5): store (quantize + scatter) and gather (gather +
dequantize) for V4-Flash shapes, as effective bytes moved per second, against a device-to-device
torch copy of the same number of bytes measured in the same run.

    python bench/datapath_gpu.py [--json FILE]

Bytes counted: store reads the bf16 rows (1024 B per KV entry) and writes the quantized entry
(data + scale bytes: 584 for fp8_ds_mla, 132 for the fp8 indexer); gather the reverse. A copy moves
its tensor's bytes twice (read + write), so it is sized to half the counted bytes. Every Triton
path is first checked byte-for-byte against the torch reference. Timing: triton.testing.do_bench,
median of CUDA-graph replays (see bench()), with warm-up; validate=False (validation syncs; it is
measured once, eagerly, for comparison, as is the eager launch).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kvatlas import formats  # noqa: E402
from kvatlas.datapath import PageGeometry, gather, store  # noqa: E402
from kvatlas.datapath.compressor import clear_rows, compress_batch  # noqa: E402

FLASH_LAYERS, FLASH_C4_LAYERS, DECODE, PREFILL = 43, 21, 1024, 16384
SWA_PAGE, INDEX_PAGE = 64, 64


GRAPH_REPS = 10


def bench(fn) -> float:
    """Median device seconds per call, from CUDA-graph replays of GRAPH_REPS calls: a decode
    step's store is ~20-60 µs of GPU work, less than Triton's Python launch cost, so eager
    timing would measure the host. Engines capture decode steps in graphs the same way."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_REPS):
            fn()
    return do_bench(graph.replay, warmup=25, rep=200, return_mode="median") / 1e3 / GRAPH_REPS


def eager(fn) -> float:
    """Median seconds per call launched from Python (host overhead included)."""
    return do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3


def copy_seconds(nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return bench(lambda: dst.copy_(src))


def pool(fmt, entries, layers, units):
    geom = PageGeometry(fmt, entries)
    return geom, torch.zeros(units, layers, geom.page_bytes, dtype=torch.uint8, device="cuda")


def decode_slots(n, entries, pages_per_req=3):
    """One token per request, each request on its own pages, random offset: a decode step."""
    g = torch.Generator(device="cuda").manual_seed(0)
    pick = torch.randint(0, pages_per_req, (n,), device="cuda", generator=g)
    page = 1 + torch.arange(n, device="cuda") * pages_per_req + pick
    return page * entries + torch.randint(0, entries, (n,), device="cuda", generator=g)


def check(geom, buf, layers, slots, x):
    ref = torch.zeros_like(buf)
    store(geom, buf, layers, slots, x, impl="triton")
    store(geom, ref, layers, slots, x, impl="torch")
    assert torch.equal(buf, ref), f"{geom.fmt.name}: Triton store bytes differ from the reference"
    a = gather(geom, buf, layers, slots, impl="triton")
    assert torch.equal(a, gather(geom, buf, layers, slots, impl="torch")), "gather differs"
    del ref
    torch.cuda.empty_cache()


def moved_bytes(fmt, layers, slots, x) -> int:
    """bf16 rows read (or written) plus quantized entry bytes written (or read)."""
    entries = len(layers) * slots.numel()
    return entries * (x.shape[-1] * x.element_size() + fmt.data_bytes + fmt.scale_bytes)


def record(rows, name, op, fn, moved, copy):
    t = bench(fn)
    rows.append({"case": name, "op": op, "bytes": moved, "seconds": t, "gbps": moved / t / 1e9,
                 "copy_gbps": moved / copy / 1e9, "vs_copy": copy / t})


def case(rows, name, fmt, geom, buf, layers, slots, x):
    """Time store and gather (one launch over `layers`) and the copy of the same bytes."""
    moved = moved_bytes(fmt, layers, slots, x)
    copy = copy_seconds(moved)
    record(rows, name, "store", lambda: store(geom, buf, layers, slots, x, validate=False), moved, copy)
    record(rows, name, "gather", lambda: gather(geom, buf, layers, slots, validate=False), moved, copy)


def per_layer(rows, name, fmt, geom, buf, layers, slots, x):
    """Same work as one launch per layer (how a model runs without fusing layers)."""
    moved = moved_bytes(fmt, layers, slots, x)
    copy = copy_seconds(moved)

    def st():
        for i, layer in enumerate(layers):
            store(geom, buf, layer, slots, x[i], validate=False)

    def ga():
        for layer in layers:
            gather(geom, buf, layer, slots, validate=False)
    record(rows, name, "store", st, moved, copy)
    record(rows, name, "gather", ga, moved, copy)


def kv_cases(rows):
    fmt = formats.FP8_DS_MLA
    layers = range(0, FLASH_LAYERS)
    geom, buf = pool(fmt, SWA_PAGE, FLASH_LAYERS, 3 * DECODE + 1)
    slots = decode_slots(DECODE, SWA_PAGE)
    x = torch.randn(FLASH_LAYERS, DECODE, 512, device="cuda").bfloat16()
    check(geom, buf, layers, slots, x)
    case(rows, "swa decode 1024 x 43 layers, one launch", fmt, geom, buf, layers, slots, x)
    per_layer(rows, "swa decode 1024 x 43 layers, 43 launches", fmt, geom, buf, layers, slots, x)
    t = eager(lambda: store(geom, buf, layers, slots, x, validate=False))
    rows.append({"case": "swa decode store, eager launch from Python", "op": "store", "seconds": t})
    t = eager(lambda: store(geom, buf, layers, slots, x, validate=True))
    rows.append({"case": "swa decode store, eager, validate=True", "op": "store", "seconds": t})
    del buf
    torch.cuda.empty_cache()
    geom, buf = pool(fmt, SWA_PAGE, 1, PREFILL // SWA_PAGE + 1)
    slots = torch.arange(SWA_PAGE, SWA_PAGE + PREFILL, device="cuda")
    x = torch.randn(1, PREFILL, 512, device="cuda").bfloat16()
    check(geom, buf, range(0, 1), slots, x)
    case(rows, "swa prefill chunk 16K tokens, one layer", fmt, geom, buf, range(0, 1), slots, x)


def indexer_cases(rows):
    fmt = formats.INDEXER_FORMATS["fp8"]
    layers = range(0, FLASH_C4_LAYERS)
    geom, buf = pool(fmt, INDEX_PAGE, FLASH_C4_LAYERS, 2 * DECODE + 1)
    slots = decode_slots(DECODE, INDEX_PAGE, 2)
    x = torch.randn(FLASH_C4_LAYERS, DECODE, 128, device="cuda").bfloat16()
    check(geom, buf, layers, slots, x)
    case(rows, "indexer fp8 decode 1024 x 21 layers", fmt, geom, buf, layers, slots, x)


def compress_cases(rows):
    """Ring append + compression for a decode step of 1024 requests, one layer (latency)."""
    rings = {4: formats.c4_attention_ring(512, spec=False), 128: formats.c128_ring(512, spec=False, online=False)}
    for ratio, ring in rings.items():
        state = torch.empty(DECODE + 1, 1, ring.rows, ring.width, device="cuda")
        clear_rows(state, torch.arange(DECODE + 1, device="cuda"))
        req = torch.arange(1, DECODE + 1, device="cuda")
        pos = torch.randint(0, 4096, (DECODE,), device="cuda")
        kv = torch.randn(DECODE, ring.width // 2, device="cuda")
        sc = torch.randn(DECODE, ring.width // 2, device="cuda")
        ref = state.clone()
        a = compress_batch(state, 0, req, pos, kv, sc, ratio=ratio, impl="triton")
        b = compress_batch(ref, 0, req, pos, kv, sc, ratio=ratio, impl="torch")
        torch.testing.assert_close(a.entries, b.entries, rtol=1e-5, atol=1e-5)
        for impl in ("triton", "torch"):
            def fn(impl=impl):
                compress_batch(state, 0, req, pos, kv, sc, ratio=ratio, validate=False, impl=impl)
            rows.append({"case": f"C{ratio} ring decode 1024 requests ({impl}, eager)", "op": "compress",
                         "seconds": eager(fn)})   # syncs once per call (data-dependent block count)


def main(json_path: str | None = None) -> None:
    rows: list[dict] = []
    kv_cases(rows)
    indexer_cases(rows)
    compress_cases(rows)
    big = 4 << 30
    ref_copy = big / copy_seconds(big) / 1e9
    print(f"{'case':48} {'op':8} {'us':>9} {'GB/s':>8} {'copy GB/s':>10} {'vs copy':>8}")
    for r in rows:
        bw = f"{r['gbps']:8.0f} {r['copy_gbps']:10.0f} {r['vs_copy']:8.2f}" if "gbps" in r else ""
        print(f"{r['case']:48} {r['op']:8} {r['seconds'] * 1e6:9.1f} {bw}")
    print(f"reference: 4 GiB device copy {ref_copy:.0f} GB/s (read + write)")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
           "copy_4gib_gbps": ref_copy}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    main(ap.parse_args().json)
