"""Round trips, error bounds, edge values and exact byte layout of every row format."""

import pytest
import torch

from kvatlas import formats
from kvatlas.datapath import (CODECS, NonFiniteError, OutOfRangeError, PageGeometry, SlotError,
                              codec_for, entries_for_page_bytes, gather, store)
from kvatlas.datapath import numerics as nm
from kvatlas.datapath.codecs import MXFP4_MAX_ABS, POW2_FP8_MAX_ABS

FP8_POW2 = {"fp8_ds_mla": 64, "unified_fp8": 64, "v41_fp8": 32, "indexer_fp8": 128}  # tile sizes
FP8_COLS = {"fp8_ds_mla": 448, "unified_fp8": 448, "v41_fp8": 512, "indexer_fp8": 128}  # quantized dims


def pool(name, entries=4, units=3, layers=2):
    codec = CODECS[name]
    geom = PageGeometry(codec.fmt, entries)
    buf = torch.zeros(units, layers, geom.page_bytes, dtype=torch.uint8)
    par = torch.zeros(units, layers, geom.parallel_page_bytes, dtype=torch.uint8) if codec.fmt.parallel_bytes else None
    return codec, geom, buf, par


def round_trip(name, x, entries=4):
    codec, geom, buf, par = pool(name, entries, units=2 + x.shape[0] // entries)
    slots = torch.arange(entries, entries + x.shape[0])  # page 1 onwards, past the null page
    store(geom, buf, 1, slots, x, parallel=par)
    return gather(geom, buf, 1, slots, parallel=par)


def tile_scales(x, tile, fmt_floor_exp=None):
    """The power-of-two scale each element's tile got, recomputed from the spec'd rule."""
    amax = nm.tile_amax(x.float(), tile)
    if fmt_floor_exp is None:
        e = nm.pow2_exponent(amax.clamp_min(1e-4), 448.0)
    else:
        e = nm.pow2_exponent(amax, 448.0).clamp_min(fmt_floor_exp)
    return nm.exponent_to_scale(e).repeat_interleave(tile, dim=-1)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_row_sizes_match_formats(name):
    codec = CODECS[name]
    rows = codec.encode(torch.randn(3, codec.width).bfloat16())
    assert rows.data.shape == (3, codec.fmt.data_bytes)
    assert rows.scale.shape == (3, codec.fmt.scale_bytes)
    assert rows.parallel.shape == (3, codec.fmt.parallel_bytes)


@pytest.mark.parametrize("name", ["bf16", "indexer_bf16"])
def test_bf16_is_exact(name):
    x = torch.randn(7, CODECS[name].width).bfloat16() * 1e3
    assert torch.equal(round_trip(name, x), x)


@pytest.mark.parametrize("name", sorted(FP8_POW2))
def test_pow2_fp8_error_bound(name):
    torch.manual_seed(1)
    width, tile, cols = CODECS[name].width, FP8_POW2[name], FP8_COLS[name]
    x = (torch.randn(16, width) * torch.logspace(-6, 4, 16)[:, None]).bfloat16()
    y = round_trip(name, x).float()
    xf = x.float()
    floor = 114 if name == "v41_fp8" else None
    s = tile_scales(xf[:, :cols], tile, floor)
    err = (y[:, :cols] - xf[:, :cols]).abs()
    # e4m3: half an ulp is 2^-4 of the value for normals, 2^-10 of the scale for subnormals
    assert bool((err <= torch.maximum(xf[:, :cols].abs() * 2 ** -4, s * 2 ** -10)).all())
    assert torch.equal(y[:, cols:], xf[:, cols:])  # rope dims stored as bf16 bits


@pytest.mark.parametrize("name", sorted(FP8_POW2))
def test_representable_values_are_exact(name):
    """e4m3 grid values times 2^k, with each tile's amax exactly 448·2^k, come back bit for bit."""
    torch.manual_seed(2)
    width, tile = CODECS[name].width, FP8_POW2[name]
    grid = torch.randint(0, 256, (8, width), dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = torch.where(grid.isnan(), 0.0, grid)
    grid.view(8, -1, tile)[:, :, 0] = 448.0
    x = (grid * 2.0 ** torch.randint(-12, 12, (8, 1))).bfloat16()
    assert torch.equal(round_trip(name, x), x)


def halfgap_e2m1(v):
    return torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, 1.0))


def test_mxfp4_error_bound_and_exact_grid():
    torch.manual_seed(3)
    x = (torch.randn(16, 128) * torch.logspace(-5, 5, 16)[:, None]).bfloat16()
    y = round_trip("indexer_fp4", x).float()
    amax = nm.tile_amax(x.float(), 32).clamp_min(6 * 2.0 ** -126)
    s = nm.exponent_to_scale(nm.pow2_exponent(amax, 6.0)).repeat_interleave(32, -1)
    v = x.float().abs() / s
    assert bool((v <= 6).all())
    assert bool(((y - x.float()).abs() <= s * halfgap_e2m1(v)).all())
    codes = torch.randint(0, 16, (4, 128), dtype=torch.uint8)
    codes.view(4, 4, 32)[:, :, 0] = 7   # each group's amax is 6·2^k
    g = (nm.e2m1_values(codes) * 2.0 ** torch.randint(-20, 20, (4, 1))).bfloat16()
    assert torch.equal(round_trip("indexer_fp4", g).float(), g.float())


def test_v41_fp4_error_bound_and_exact_grid():
    torch.manual_seed(4)
    x = (torch.randn(16, 512) * torch.logspace(-3, 2.5, 16)[:, None]).bfloat16()
    y = round_trip("v41_fp4", x).float()
    xs = x.float().unflatten(-1, (-1, 16))
    s = (xs.abs().amax(-1) / 6).clamp(2.0 ** -9, 448).to(torch.float8_e4m3fn).float()
    s = s.repeat_interleave(16, -1)
    v = x.float().abs() / s
    # a subnormal e4m3 scale may round down far enough that |x|/s passes 6: then it saturates
    assert bool(((y - x.float()).abs() <= s * (halfgap_e2m1(v) + (v - 6).clamp_min(0))).all())
    assert bool((v[s >= 2.0 ** -6] <= 6 * 16 / 15).all())  # a normal scale is within 2^-4
    codes = torch.randint(0, 16, (4, 512), dtype=torch.uint8)
    codes.view(4, 32, 16)[:, :, 3] = 15   # amax 6·s, s an e4m3 value
    sc = torch.tensor([0.5, 1.0, 1.125, 40.0])[:, None]
    g = (nm.e2m1_values(codes) * sc).bfloat16()
    assert torch.equal(round_trip("v41_fp4", g).float(), g.float())


def test_uniform_fp8_fixed_scale():
    x = (torch.rand(4, 512) * 800 - 400).bfloat16()
    y = round_trip("uniform_fp8", x).float()
    assert bool(((y - x.float()).abs() <= torch.maximum(x.float().abs() * 2 ** -4, torch.tensor(2 ** -10))).all())
    codec, geom, buf, _ = pool("uniform_fp8")
    with pytest.raises(OutOfRangeError):
        store(geom, buf, 0, torch.tensor([4]), torch.full((1, 512), 500.0).bfloat16())
    scaled = codec_for(formats.UNIFORM_FP8_KV, scale=4.0)
    store(geom, buf, 0, torch.tensor([4]), torch.full((1, 512), 1024.0).bfloat16(), codec=scaled)
    assert torch.equal(gather(geom, buf, 0, torch.tensor([4]), codec=scaled).float(), torch.full((1, 512), 1024.0))


def assert_scales_finite(name, rows):
    """Zero tiles must not produce NaN scales (e8m0 255, e4m3 0x7F/0xFF, fp32 NaN/0)."""
    if name == "indexer_fp8":
        assert bool((rows.scale.contiguous().view(torch.float32) > 0).all())
    elif name == "v41_fp4":
        assert bool((rows.scale.view(torch.float8_e4m3fn).float() > 0).all())
    elif name == "unified_fp8":
        assert bool(((rows.data[:, 448:455] > 0) & (rows.data[:, 448:455] < 255)).all())
    elif rows.scale.numel():
        real = rows.scale[:, :7] if name == "fp8_ds_mla" else rows.scale
        assert bool(((real > 0) & (real < 255)).all())


@pytest.mark.parametrize("name", sorted(CODECS))
def test_zeros_tiny_and_max(name):
    codec = CODECS[name]
    w = codec.width
    zeros = torch.zeros(1, w).bfloat16()
    assert torch.equal(round_trip(name, zeros).float().abs(), zeros.float())  # -0 allowed
    assert_scales_finite(name, codec.encode(zeros))
    tiny = torch.full((1, w), 2.0 ** -133).bfloat16()            # smallest bf16 subnormal
    assert bool((round_trip(name, tiny).float() - tiny.float()).abs().max() <= 2.0 ** -20)
    top = min(codec.max_abs, 3.0e38)
    big = torch.tensor([[top, -top] * (w // 2)]).bfloat16()
    big = torch.where(big.float().abs() > codec.max_abs, big.float() * 0.99, big.float()).bfloat16()
    back = round_trip(name, big).float()
    assert bool(back.isfinite().all())
    assert bool(((back - big.float()).abs() <= big.float().abs() * 0.2).all())


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_refused_and_nothing_written(name, bad):
    codec, geom, buf, par = pool(name)
    x = torch.randn(2, codec.width).bfloat16()
    x[1, 5] = bad
    before = buf.clone()
    with pytest.raises(NonFiniteError) as e:
        store(geom, buf, 0, torch.tensor([4, 5]), x, parallel=par)
    assert isinstance(e.value, ValueError) and "NaN or Inf" in str(e.value)
    assert torch.equal(buf, before)


@pytest.mark.parametrize("name", ["fp8_ds_mla", "v41_fp8", "indexer_fp8", "indexer_fp4"])
def test_values_that_would_round_to_inf_are_refused(name):
    codec, geom, buf, par = pool(name)
    x = torch.zeros(1, codec.width)
    x[0, 0] = 3.3895e38   # bf16 max
    with pytest.raises(OutOfRangeError):
        store(geom, buf, 0, torch.tensor([4]), x.bfloat16(), parallel=par)
    assert codec.max_abs in (POW2_FP8_MAX_ABS, MXFP4_MAX_ABS)


def test_fp8_ds_mla_golden_bytes_and_page_layout():
    """Exact byte positions: entry j's 576 data bytes at j*576, its 8 scale bytes at P*576 + j*8."""
    codec, geom, buf, _ = pool("fp8_ds_mla", entries=4)
    assert geom.page_bytes == formats.FP8_DS_MLA.page_bytes(4) == 2880  # 4·584 = 2336 -> 5·576
    x = torch.zeros(1, 512)
    x[0, :64] = 1.0            # tile 0: amax 1 -> scale 2^-8 (byte 119), value 256 = e4m3 0x78
    x[0, 64:128] = -3.0        # tile 1: 3/448 -> 2^-7 (byte 120), -3·2^7 = -384 = e4m3 0xFC
    x[0, 448] = 1.0            # first rope dim: bf16 0x3F80, little endian
    slot = 1 * 4 + 2           # page 1, offset 2
    store(geom, buf, 1, torch.tensor([slot]), x.bfloat16())
    page = buf[1, 1]
    d0, s0 = 2 * 576, 4 * 576 + 2 * 8
    assert page[d0:d0 + 64].tolist() == [0x78] * 64
    assert page[d0 + 64:d0 + 128].tolist() == [0xFC] * 64
    assert page[d0 + 448:d0 + 450].tolist() == [0x80, 0x3F]
    assert page[s0:s0 + 8].tolist() == [119, 120] + [105] * 5 + [0]  # zero tiles: 1e-4 floor -> 2^-22
    written = torch.zeros_like(buf, dtype=torch.bool)
    written[1, 1, d0:d0 + 576] = True
    written[1, 1, s0:s0 + 8] = True
    assert not bool(buf[~written].any())          # nothing else in the buffer changed
    assert geom.data_span(2) == (d0, d0 + 576) and geom.scale_span(2) == (s0, s0 + 8)


def test_indexer_layouts_golden():
    _, geom, buf, _ = pool("indexer_fp4", entries=2)
    x = torch.zeros(1, 128)
    x[0, :3] = torch.tensor([1.0, -0.5, 6.0])     # group 0: amax 6 -> scale 2^0, byte 127
    store(geom, buf, 0, torch.tensor([3]), x.bfloat16())   # page 1, offset 1
    page = buf[1, 0]
    assert page[64:67].tolist() == [0x92, 0x07, 0x00]      # low nibble = even element
    assert page[2 * 64 + 4:2 * 64 + 8].tolist()[0] == 127
    _, geom, buf, _ = pool("indexer_fp8", entries=2)
    x = torch.zeros(1, 128)
    x[0, 0] = 448.0
    store(geom, buf, 0, torch.tensor([3]), x.bfloat16())
    page = buf[1, 0]
    assert page[128] == 0x7E                                # 448 in e4m3
    assert page[256 + 4:256 + 8].contiguous().view(torch.float32).item() == 1.0


def test_unified_and_v41_layouts():
    codec, geom, buf, par = pool("unified_fp8", entries=2)
    x = torch.randn(1, 512).bfloat16()
    store(geom, buf, 0, torch.tensor([3]), x, parallel=par)
    assert torch.equal(par[1, 0, 128:256].view(torch.bfloat16), x[0, 448:])
    assert not bool(buf[1, 0, 512 + 448 + 7:1024].any())   # row pad stays zero
    assert buf[1, 0, 512 + 448:512 + 455].min() > 0         # 7 exponent bytes
    _, geom, buf, _ = pool("v41_fp8", entries=3)
    store(geom, buf, 0, torch.tensor([5]), x)
    rows = CODECS["v41_fp8"].encode(x)
    assert torch.equal(buf[1, 0, 2 * 512:3 * 512], rows.data[0])
    assert torch.equal(buf[1, 0, 3 * 512 + 2 * 16:3 * 512 + 3 * 16], rows.scale[0])


def test_page_geometry_inversion_and_checks():
    for fmt in (formats.FP8_DS_MLA, formats.INDEXER_FORMATS["fp8"], formats.V41_COMPRESSED_KV):
        for p in (1, 2, 3, 64, 256):
            assert entries_for_page_bytes(fmt, fmt.page_bytes(p)) == p
    codec, geom, buf, _ = pool("fp8_ds_mla")
    x = torch.randn(2, 512).bfloat16()
    with pytest.raises(SlotError):
        store(geom, buf, 0, torch.tensor([4, 12]), x)          # slot 12 is past 3 pages of 4
    with pytest.raises(SlotError):
        store(geom, buf, 0, torch.tensor([5, 5]), x)           # duplicate live slot
    with pytest.raises(SlotError, match="null page"):
        store(geom, buf, 0, torch.tensor([0, 5]), x)           # the null page: readers expect zeros
    assert buf[0].count_nonzero() == 0
    store(geom, buf, 0, torch.tensor([0, 0]), x, allow_null=True)   # padding on purpose may repeat
    with pytest.raises(SlotError):
        store(geom, buf, 2, torch.tensor([4, 5]), x)           # layer out of range
    with pytest.raises(SlotError):
        store(PageGeometry(codec.fmt, 8), buf, 0, torch.tensor([4, 5]), x)


def test_multi_layer_and_batch_shapes():
    codec, geom, buf, _ = pool("fp8_ds_mla", layers=3)
    x = torch.randn(3, 5, 512).bfloat16()
    slots = torch.tensor([4, 5, 6, 9, 10])
    store(geom, buf, range(0, 3), slots, x)
    y = gather(geom, buf, range(0, 3), slots)
    assert y.shape == (3, 5, 512)
    assert torch.equal(gather(geom, buf, 1, slots), y[1])
    table = slots.reshape(1, 5)[:, [4, 0, 2]]
    assert gather(geom, buf, 2, table).shape == (1, 3, 512)
