"""The Triton kernels run on CPU under TRITON_INTERPRET=1 and must match the torch reference.

Skipped where triton is not installed (the CPU-only venv). The interpreter must be switched on
before triton is imported, so the checks run in a child process.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

E4M3 = """
import torch, triton, triton.language as tl
from kvatlas.datapath.kernels.codec_triton import e4m3_rne

@triton.jit
def k(x_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, e4m3_rne(tl.load(x_ptr + i)))

codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
grid = codes[codes.isfinite() & (codes.abs() <= 448)].unique()
mids = (grid[1:] + grid[:-1]) / 2                     # exact ties
near = torch.cat([mids * (1 + 2.0 ** -20), mids * (1 - 2.0 ** -20)])
bf = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
bf = bf[bf.isfinite() & (bf.abs() <= 448)]
x = torch.cat([grid, mids, near, bf, torch.randn(4096) * 10]).float()
x = x[x.abs() <= 448]
n = 1 << (x.numel() - 1).bit_length()
x = torch.cat([x, torch.zeros(n - x.numel())])
out = torch.empty(n, dtype=torch.uint8)
k[(1,)](x, out, N=n)
want = x.to(torch.float8_e4m3fn).view(torch.uint8)
bad = (out != want).nonzero().flatten()
assert bad.numel() == 0, [(x[i].item(), out[i].item(), want[i].item()) for i in bad[:5]]
print("ok", n)
"""

KERNELS = """
import torch
from kvatlas.datapath import CODECS, PageGeometry, gather, store
from kvatlas.datapath import compressor as C
from kvatlas.datapath.kernels import codec_triton, compress_triton

torch.manual_seed(0)
for name, entries in [("fp8_ds_mla", 4), ("fp8_ds_mla", 2), ("indexer_fp8", 4)]:
    codec = CODECS[name]
    geom = PageGeometry(codec.fmt, entries)
    units, layers, n = 6, 3, 9
    slab = torch.zeros(units * layers * geom.page_bytes + 512, dtype=torch.uint8)
    tri = slab[512:].view(units, layers, geom.page_bytes)
    ref = torch.zeros_like(tri)
    slots = torch.randperm(units * entries - entries)[:n] + entries
    x = (torch.randn(layers, n, codec.width) * torch.logspace(-8, 6, n)[:, None]).bfloat16()
    x[:, 0] = 0
    store(geom, ref, range(0, layers), slots, x, impl="torch")
    codec_triton.store(codec, geom, tri, range(0, layers), slots, x)
    assert torch.equal(ref, tri), name
    got = codec_triton.gather(codec, geom, ref, range(0, layers), slots)
    assert torch.equal(got, gather(geom, ref, range(0, layers), slots, impl="torch")), name
    ops = codec_triton.LayerOps(codec, geom, tri, 1)       # one layer, its fixed arguments made once
    ops.store(slots[:4], x[1, 5:9])
    store(geom, ref, 1, slots[:4], x[1, 5:9], impl="torch")
    assert torch.equal(ref, tri), name
    assert torch.equal(ops.gather(slots), gather(geom, ref, 1, slots, impl="torch")), name
    group = codec_triton.LayerOps(codec, geom, ref, 1, 2)  # two layers read in one launch
    assert torch.equal(group.gather(slots), gather(geom, ref, range(1, 3), slots, impl="torch")), name
    if ops.steps:                                          # the SWA's decode step: store then gather, one launch
        store(geom, ref, 1, slots[-1:], x[2, :1], impl="torch")
        assert torch.equal(ops.step(slots, x[2, :1]), gather(geom, ref, 1, slots, impl="torch")), name
        assert torch.equal(ref, tri), name

for ratio, ring, d, dt in [(4, 8, 64, torch.float32), (4, 16, 32, torch.bfloat16),
                           (128, 128, 32, torch.float32), (128, 256, 32, torch.bfloat16)]:
    coff = 2 if ratio == 4 else 1
    state = torch.empty(5, 2, ring, 2 * coff * d, dtype=dt)
    C.clear_rows(state, torch.arange(5))
    ref = state.clone()
    ape = torch.randn(ratio, coff * d)
    lens = {1: 0, 3: 0, 4: 0}
    for n in (3 * ratio + 1, 1, 5, 2 * ratio, 1, 1, ratio - 1):
        req = torch.cat([torch.full((n,), s) for s in lens])
        pos = torch.cat([torch.arange(p, p + n) for p in lens.values()])
        kv, sc = torch.randn(len(pos), coff * d), torch.randn(len(pos), coff * d) * 3
        want = C.compress_batch(ref, 1, req, pos, kv, sc, ratio=ratio, ape=ape, impl="torch")
        args = (C.CompressorSpec.for_state(state, ratio), state, 1, req, pos, C.plan_batch(ratio, req, pos),
                kv, sc, ape)
        got = compress_triton.compress(*args)
        compress_triton.append(*args)
        torch.testing.assert_close(got, want.entries, rtol=1e-5, atol=1e-5)
        assert torch.equal(state, ref)
        lens = {s: p + n for s, p in lens.items()}
print("ok")
"""


WRITE = """
import torch
from write_steps import assert_same, clones, concat, inputs, make_cache, targets
from kvatlas.datapath import StepIndices, write_layer
from kvatlas.datapath.write import _rings
from kvatlas.datapath.kernels import write_triton

# a long chunk (two launches), a two-request chunk, a decode step; every pool and ring, exact
cache = make_cache()
ref = clones(cache)
tt, rt = targets(cache), targets(cache, ref)
with cache.allocator.forward():
    steps = [cache.extend("a", 150), concat(cache.extend("b", 140), cache.extend("c", 9))]
steps.append(cache.step(["a", "b", "c"]))
for s, w in enumerate(steps):
    step = StepIndices.of(w, "cpu", ratios=(4, 128))
    for layer, t in tt.items():
        x = inputs(w.num_tokens, t, 1000 * s + layer, "cpu")
        write_triton.write_layer(step, t, x["swa_kv"], _rings(t, x.get("kv"), x.get("score"), x.get("index_kv"),
                                                              x.get("index_score")))
        write_layer(step, rt[layer], impl="torch", **x)
assert_same(cache, ref)
print("ok")
"""


@pytest.mark.parametrize("script", [E4M3, KERNELS, WRITE], ids=["e4m3_rne", "kernels", "write_layer"])
def test_under_interpreter(script):
    env = dict(os.environ, TRITON_INTERPRET="1")
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, here, env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
