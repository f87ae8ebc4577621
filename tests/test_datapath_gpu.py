"""Triton kernels against the torch reference (CUDA only; skipped without a device)."""

import pytest
import torch

from kvatlas.datapath import CODECS, PageGeometry, gather, store
from kvatlas.datapath.compressor import clear_rows, compress_batch

pytestmark = pytest.mark.gpu

KERNEL_FORMATS = [("fp8_ds_mla", 64), ("fp8_ds_mla", 2), ("indexer_fp8", 64)]


def slab_buffer(geom, units, layers):
    """A strided view carved from a larger slab, like the arena's views."""
    slab = torch.zeros(units * layers * geom.page_bytes + 512, dtype=torch.uint8, device="cuda")
    return slab[512:].view(units, layers, geom.page_bytes)


def values(n, width, layers=None):
    shape = (layers, n, width) if layers else (n, width)
    x = torch.randn(shape, device="cuda") * torch.logspace(-8, 6, n, device="cuda")[:, None]
    x[..., 0, :] = 0.0                    # a zero row: zero tiles
    return x.bfloat16()


@pytest.mark.parametrize("name,entries", KERNEL_FORMATS)
def test_store_and_gather_bytes_match_reference(name, entries):
    codec = CODECS[name]
    geom = PageGeometry(codec.fmt, entries)
    units, layers, n = 40, 3, 50
    slots = torch.randperm(units * entries - entries, device="cuda")[:n] + entries
    x = values(n, codec.width, layers)
    ref, tri = slab_buffer(geom, units, layers), slab_buffer(geom, units, layers)
    store(geom, ref, range(0, layers), slots, x, impl="torch")
    store(geom, tri, range(0, layers), slots, x, impl="triton")
    assert torch.equal(ref, tri)
    g_ref = gather(geom, ref, range(0, layers), slots, impl="torch")
    g_tri = gather(geom, ref, range(0, layers), slots, impl="triton")
    assert torch.equal(g_ref, g_tri)
    store(geom, tri, 1, slots[:7], x[0, :7], impl="triton")    # one layer, int position
    store(geom, ref, 1, slots[:7], x[0, :7], impl="torch")
    assert torch.equal(ref, tri)


@pytest.mark.parametrize("name,entries", KERNEL_FORMATS)
def test_layer_ops_repeated_launches_match_reference(name, entries):
    """LayerOps (fixed arguments made once; after each specialization's first launch, the kernel
    launched straight through triton's compiled launcher) writes and reads the reference's bytes,
    call after call: slot tensors at aligned and unaligned addresses, one slot (n == 1) and many,
    the value rows contiguous or not, so several specialization keys are made and reused."""
    from kvatlas.datapath.kernels import codec_triton as ct
    codec = CODECS[name]
    geom = PageGeometry(codec.fmt, entries)
    units, layers = 40, 3
    ref, tri = slab_buffer(geom, units, layers), slab_buffer(geom, units, layers)
    ops = ct.LayerOps(codec, geom, tri, 1)
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(24):
        n = (1, 7, 16, 33)[step % 4]
        pool = torch.randperm(units * entries - entries, device="cuda", generator=g) + entries
        flat = torch.cat([torch.zeros(step % 2, dtype=torch.int64, device="cuda"), pool[:n]])
        slots = flat[step % 2:]                  # odd steps: an address 8 bytes past a 16-byte boundary
        x = values(n, codec.width)
        if step % 3 == 0:
            x = torch.cat([x, x], 1)[:, : codec.width]   # rows with a stride past their width
        ops.store(slots, x)
        store(geom, ref, 1, slots, x, impl="torch")
        assert torch.equal(ref, tri), f"store, step {step}"
        got = ops.gather(slots)
        assert torch.equal(got, gather(geom, ref, 1, slots, impl="torch")), f"gather, step {step}"
    if ct.DIRECT:
        assert any(len(v.compiled) > 1 for v in ct._LAUNCHES.values())   # several keys were made and launched


@pytest.mark.parametrize("name,entries", KERNEL_FORMATS)
def test_layer_ops_reads_several_layers_in_one_launch(name, entries):
    """LayerOps over consecutive layers (the transformers adapter's group reads) returns what
    gather of those layers returns, call after call, aligned and unaligned slots, in its shape
    or a caller's; it writes one layer only."""
    from kvatlas.datapath.kernels import codec_triton as ct
    codec = CODECS[name]
    geom = PageGeometry(codec.fmt, entries)
    units, layers = 400 // entries + 2, 4
    buf = slab_buffer(geom, units, layers)
    g = torch.Generator(device="cuda").manual_seed(3)
    fill = torch.randperm(units * entries - entries, device="cuda", generator=g)[:300] + entries
    store(geom, buf, range(0, layers), fill, values(300, codec.width, layers), impl="torch")
    ops = ct.LayerOps(codec, geom, buf, 1, 3)
    for step, n in enumerate((1, 7, 64, 300, 33)):
        flat = torch.cat([torch.zeros(step % 2, dtype=torch.int64, device="cuda"), fill[torch.randperm(300, device="cuda", generator=g)[:n]]])
        slots = flat[step % 2:]
        want = gather(geom, buf, range(1, 4), slots, impl="torch")
        assert torch.equal(ops.gather(slots), want), f"step {step}"
        assert torch.equal(ops.gather(slots, (3, 1, n, codec.width)), want[:, None]), f"step {step}"
    with pytest.raises(ValueError, match="one layer"):
        ops.store(slots, values(n, codec.width))
    with pytest.raises(ValueError, match="outside"):
        ct.LayerOps(codec, geom, buf, 2, 3)


def test_layer_ops_step_is_store_then_gather():
    """A decode step's window in one launch (LayerOps.step: the row stored at the last slot, every
    slot read, the new one from registers) leaves the same bytes and returns the same values as
    store then gather, for windows of 1 to 200 slots at aligned and unaligned addresses."""
    from kvatlas.datapath.kernels import codec_triton as ct
    codec = CODECS["fp8_ds_mla"]
    geom = PageGeometry(codec.fmt, 64)
    units, layers = 40, 3
    ref, fused = slab_buffer(geom, units, layers), slab_buffer(geom, units, layers)
    g = torch.Generator(device="cuda").manual_seed(2)
    fill = torch.randperm(units * 64 - 64, device="cuda", generator=g)[:600] + 64
    x = values(600, codec.width, layers)
    store(geom, ref, range(0, layers), fill, x, impl="torch")
    fused.copy_(ref)
    ops = ct.LayerOps(codec, geom, fused, 2)
    for step, n in enumerate((1, 2, 7, 128, 128, 200, 33)):
        pool = torch.randperm(units * 64 - 64, device="cuda", generator=g) + 64
        flat = torch.cat([torch.zeros(step % 2, dtype=torch.int64, device="cuda"), pool[:n]])
        slots = flat[step % 2:]
        row = values(2, codec.width)[1:]                  # a row with nonzero tiles
        store(geom, ref, 2, slots[-1:], row, impl="torch")
        want = gather(geom, ref, 2, slots, impl="torch")
        got = ops.step(slots, row)
        assert torch.equal(ref, fused), f"bytes, step {step}"
        assert torch.equal(got, want), f"values, step {step}"


@pytest.mark.parametrize("ratio,ring,d,state_dtype", [
    (4, 8, 512, torch.float32), (4, 16, 128, torch.float32), (128, 128, 512, torch.float32),
    (128, 256, 512, torch.bfloat16), (4, 8, 512, torch.bfloat16)])
def test_ring_compression_matches_reference(ratio, ring, d, state_dtype):
    coff = 2 if ratio == 4 else 1
    torch.manual_seed(0)
    state = torch.empty(5, 2, ring, 2 * coff * d, device="cuda", dtype=state_dtype)
    clear_rows(state, torch.arange(5, device="cuda"))
    ape = torch.randn(ratio, coff * d, device="cuda")
    ref_state = state.clone()
    lens = {1: 0, 3: 0, 4: 0}
    for n in (3 * ratio + 1, 1, 5, 2 * ratio, 1, 1, ratio - 1):   # prefill, decode, chunk ...
        req = torch.cat([torch.full((n,), s, device="cuda") for s in lens])
        pos = torch.cat([torch.arange(p, p + n, device="cuda") for p in lens.values()])
        kv = torch.randn(len(pos), coff * d, device="cuda")
        sc = torch.randn(len(pos), coff * d, device="cuda") * 3
        a = compress_batch(ref_state, 1, req, pos, kv, sc, ratio=ratio, ape=ape, impl="torch")
        b = compress_batch(state, 1, req, pos, kv, sc, ratio=ratio, ape=ape, impl="triton")
        assert torch.equal(a.block_ids, b.block_ids) and torch.equal(a.req_slots, b.req_slots)
        torch.testing.assert_close(b.entries, a.entries, rtol=1e-5, atol=1e-5)
        assert torch.equal(state, ref_state)
        lens = {s: p + n for s, p in lens.items()}


@pytest.mark.parametrize("options", [dict(), dict(draft_tokens=2, state_dtype="bf16")], ids=["v4", "drafts-bf16"])
def test_write_layer_graph_replays_decode_steps_byte_for_byte(options):
    """Prefill eagerly (two launches for long runs), then capture one decode step's writes of every
    layer in a CUDA graph and replay it over several steps: every pool and ring equals the torch
    reference, byte for byte, after each step."""
    from kvatlas.datapath import StepIndices, write_layer
    from write_steps import REQUESTS, assert_same, clones, inputs, make_cache, schedule, targets

    cache = make_cache("cuda", **options)
    ref = clones(cache)
    tt, rt = targets(cache), targets(cache, ref)
    steps = schedule(cache, options.get("draft_tokens", 0))
    for s in range(3):                                   # chunked prefills, a two-request chunk
        w = next(steps)
        step = StepIndices.of(w, "cuda", ratios=(4, 128))
        for layer, t in tt.items():
            x = inputs(w.num_tokens, t, 100 * s + layer, "cuda")
            write_layer(step, t, impl="triton", **x)
            write_layer(step, rt[layer], impl="torch", **x)
    torch.cuda.synchronize()
    assert_same(cache, ref)
    step = StepIndices.of(next(steps), "cuda", ratios=(4, 128))
    static = {layer: inputs(step.num_tokens, t, layer, "cuda") for layer, t in tt.items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer, t in tt.items():
            write_layer(step, t, impl="triton", **static[layer])
    for k in range(6):
        if k:
            step.load(cache.step(list(REQUESTS), 1 + options.get("draft_tokens", 0)))
        for layer, t in tt.items():
            for name, v in inputs(step.num_tokens, t, 1000 * k + layer, "cuda").items():
                static[layer][name].copy_(v)
        graph.replay()
        for layer in tt:
            write_layer(step, rt[layer], impl="torch", **static[layer])
        torch.cuda.synchronize()
        assert_same(cache, ref)
