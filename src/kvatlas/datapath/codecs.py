"""Row codecs: bf16 vectors <-> the bytes of one entry, for every row format in `formats`.

A codec turns values [n, width] into three byte tensors — the data row [n, data_bytes], the scale
row [n, scale_bytes] and the parallel row [n, parallel_bytes] (empty where a format has none) — and
back. Where those rows sit in a page is `geometry`'s business, so every format shares one scatter.

Scale conventions (all documented choices):
- fp8_ds_mla (FlashMLA MODEL1_FP8Sparse): per 64 nope dims a power-of-two scale from
  max(amax, 1e-4) / 448 rounded up (the official `act_quant` / SGLang store rule); the byte after
  the 7 exponents is written 0. Rope dims are stored as the input's bf16 bits.
- unified fp8: the same nope numerics in a 512-B row (448 fp8, 7 exponents, zero pad); rope bf16
  in the parallel row.
- uniform fp8: one fixed per-pool scale (default 1.0, like TRT-LLM's kv_cache_scale); values
  beyond ±448·scale are refused, not clamped.
- V4.1 fp8 (528): per 32 values a power-of-two scale of max(amax/448, 2^-13) (FlashMLA-test /
  SGLang floor of exponent byte 114).
- V4.1 fp4 (288): per 16 values an e4m3 scale e4m3(clamp(amax/6, 2^-9, 448)), e2m1 codes round
  half to even (SGLang's V4.1 reference); |x| > 6·448 is refused.
- indexer fp8 (132): per 128 a power-of-two scale (vLLM's choice; SGLang's plain amax/448 reads back
  the same, since the stored scale is a full fp32).
- indexer fp4 (68, MXFP4): per 32 a ue8m0 scale 2^ceil(log2(amax/6)), amax >= 6·2^-126 (official
  `fp4_act_quant`); e2m1 round half to even.
- fp32 / fp64 (a float model's own rows, kvatlas.formats FP32_KV / FP64_KV and the indexer's): the
  values' bits as they are; these codecs take and give their own dtype (`Codec.dtype`), not bf16.
Dequantized values are exactly representable in bf16 for every other format, so gather adds no
rounding. Values so large that rounding would carry them to 2^128 (|x| near bf16 max) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..planning import formats
from . import numerics as nm

KV_WIDTH, NOPE, ROPE, INDEX_WIDTH = 512, 448, 64, 128
DS_MLA_TILE, V41_FP8_TILE, V41_FP4_TILE, MXFP4_TILE = 64, 32, 16, 32
_AMAX_FLOOR = 1e-4
_V41_FP8_MIN_EXP = int(nm.pow2_exponent(torch.tensor([_AMAX_FLOOR]), 1.0)[0])  # 2^-13 -> byte 114
_V41_FP4_MIN_SCALE = 2.0 ** -9          # smallest e4m3 subnormal
_MXFP4_AMAX_FLOOR = nm.E2M1_MAX * 2.0 ** -126
_BF16 = torch.bfloat16
# Largest |x| whose round trip stays finite: above it the top code rounds up to 2^128 (inf), e.g.
# bf16 max 1.99·2^127 -> fp8 256 · 2^120. Such values are refused rather than turned into inf.
POW2_FP8_MAX_ABS = (1.9375 - 2.0 ** -7) * 2.0 ** 127     # below the 248·2^120 rounding boundary
MXFP4_MAX_ABS = (1.75 - 2.0 ** -7) * 2.0 ** 127          # below the 3.5·2^126 rounding boundary


@dataclass(frozen=True, slots=True)
class Rows:
    data: torch.Tensor
    scale: torch.Tensor
    parallel: torch.Tensor


@dataclass(frozen=True, slots=True)
class Codec:
    fmt: formats.RowFormat
    width: int
    encode: Callable[[torch.Tensor], Rows]      # bf16 [n, width] -> Rows
    decode: Callable[[Rows], torch.Tensor]      # Rows -> dtype [n, width]
    max_abs: float = float("inf")               # largest |x| stored without clamping
    dtype: torch.dtype = torch.bfloat16         # what encode takes (values are cast to it) and decode gives
    raw: bool = False                           # an entry's data bytes are its values in dtype, nothing else


def _empty(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty((n, 0), dtype=torch.uint8, device=like.device)


def _bf16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(_BF16).contiguous().view(torch.uint8)


def _from_bf16_bytes(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(_BF16)


# ---- power-of-two tiled fp8 (nope of fp8_ds_mla / unified, all of V4.1 fp8, indexer fp8) ----

def _fp8_tiles(x: torch.Tensor, tile: int, exp_of_amax) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [n, k*tile] -> (e4m3 bytes [n, k*tile], exponent int32 [n, k])."""
    e = exp_of_amax(nm.tile_amax(x, tile))
    q = nm.to_e4m3_bytes(x.unflatten(-1, (-1, tile)) * nm.inverse_scale(e)[..., None])
    return q.flatten(-2), e


def _fp8_untile(q: torch.Tensor, e: torch.Tensor, tile: int) -> torch.Tensor:
    vals = nm.from_e4m3_bytes(q).unflatten(-1, (-1, tile)) * nm.exponent_to_scale(e)[..., None]
    return vals.flatten(-2)


def _ds_mla_exp(amax: torch.Tensor) -> torch.Tensor:
    return nm.pow2_exponent(amax.clamp_min(_AMAX_FLOOR), nm.E4M3_MAX)


def _nope_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _fp8_tiles(x[:, :NOPE].float(), DS_MLA_TILE, _ds_mla_exp)


def _ds_mla_encode(x):
    q, e = _nope_rows(x)
    pad = torch.zeros((x.shape[0], 1), dtype=torch.uint8, device=x.device)
    return Rows(torch.cat((q, _bf16_bytes(x[:, NOPE:])), 1), torch.cat((e.to(torch.uint8), pad), 1),
                _empty(x.shape[0], x))


def _ds_mla_decode(r: Rows):
    nope = _fp8_untile(r.data[:, :NOPE], r.scale[:, :NOPE // DS_MLA_TILE], DS_MLA_TILE)
    return torch.cat((nope.to(_BF16), _from_bf16_bytes(r.data[:, NOPE:])), 1)


def _unified_encode(x):
    q, e = _nope_rows(x)
    pad = torch.zeros((x.shape[0], formats.UNIFIED_FP8_KV.pad_bytes), dtype=torch.uint8, device=x.device)
    return Rows(torch.cat((q, e.to(torch.uint8), pad), 1), _empty(x.shape[0], x), _bf16_bytes(x[:, NOPE:]))


def _unified_decode(r: Rows):
    tiles = NOPE // DS_MLA_TILE
    nope = _fp8_untile(r.data[:, :NOPE], r.data[:, NOPE:NOPE + tiles], DS_MLA_TILE)
    return torch.cat((nope.to(_BF16), _from_bf16_bytes(r.parallel)), 1)


def _v41_fp8_encode(x):
    exp = lambda a: nm.pow2_exponent(a, nm.E4M3_MAX).clamp_min(_V41_FP8_MIN_EXP)
    q, e = _fp8_tiles(x.float(), V41_FP8_TILE, exp)
    return Rows(q, e.to(torch.uint8), _empty(x.shape[0], x))


def _v41_fp8_decode(r: Rows):
    return _fp8_untile(r.data, r.scale, V41_FP8_TILE).to(_BF16)


def _index_fp8_encode(x):
    q, e = _fp8_tiles(x.float(), INDEX_WIDTH, _ds_mla_exp)
    scale = nm.exponent_to_scale(e).contiguous().view(torch.uint8)
    return Rows(q, scale, _empty(x.shape[0], x))


def _index_fp8_decode(r: Rows):
    scale = r.scale.contiguous().view(torch.float32)  # any fp32 scale reads back, pow2 or not
    return (nm.from_e4m3_bytes(r.data) * scale).to(_BF16)


# ---- fp4 ----

def _mxfp4_encode(x):
    xf = x.float()
    e = nm.pow2_exponent(nm.tile_amax(xf, MXFP4_TILE).clamp_min(_MXFP4_AMAX_FLOOR), nm.E2M1_MAX)
    codes = nm.e2m1_codes(xf.unflatten(-1, (-1, MXFP4_TILE)) * nm.inverse_scale(e)[..., None])
    return Rows(nm.pack_nibbles(codes.flatten(-2)), e.to(torch.uint8), _empty(x.shape[0], x))


def _mxfp4_decode(r: Rows):
    vals = nm.e2m1_values(nm.unpack_nibbles(r.data)).unflatten(-1, (-1, MXFP4_TILE))
    return (vals * nm.exponent_to_scale(r.scale)[..., None]).flatten(-2).to(_BF16)


def _v41_fp4_encode(x):
    xf = x.float().unflatten(-1, (-1, V41_FP4_TILE))
    sf = (xf.abs().amax(-1) / nm.E2M1_MAX).clamp(_V41_FP4_MIN_SCALE, nm.E4M3_MAX)
    s = sf.to(torch.float8_e4m3fn)
    codes = nm.e2m1_codes(xf / s.float()[..., None])
    return Rows(nm.pack_nibbles(codes.flatten(-2)), s.view(torch.uint8), _empty(x.shape[0], x))


def _v41_fp4_decode(r: Rows):
    vals = nm.e2m1_values(nm.unpack_nibbles(r.data)).unflatten(-1, (-1, V41_FP4_TILE))
    return (vals * nm.from_e4m3_bytes(r.scale)[..., None]).flatten(-2).to(_BF16)


# ---- raw bf16 and fixed-scale fp8 ----

def _bf16_encode(x):
    return Rows(_bf16_bytes(x), _empty(x.shape[0], x), _empty(x.shape[0], x))


def _bf16_decode(r: Rows):
    return _from_bf16_bytes(r.data)


def _raw_codec(fmt: formats.RowFormat, width: int, dtype: torch.dtype) -> Codec:
    """A float row stored bit for bit in its own dtype (no quantization, no scale)."""
    enc = lambda x: Rows(x.to(dtype).contiguous().view(torch.uint8), _empty(x.shape[0], x), _empty(x.shape[0], x))
    dec = lambda r: r.data.contiguous().view(dtype)
    return Codec(fmt, width, enc, dec, dtype=dtype, raw=True)


def uniform_fp8_codec(scale: float = 1.0) -> Codec:
    """Uniform fp8 with a fixed per-pool scale: x = e4m3 · scale."""
    enc = lambda x: Rows(nm.to_e4m3_bytes(x.float() / scale), _empty(x.shape[0], x), _empty(x.shape[0], x))
    dec = lambda r: (nm.from_e4m3_bytes(r.data) * scale).to(_BF16)
    return Codec(formats.UNIFORM_FP8_KV, KV_WIDTH, enc, dec, max_abs=nm.E4M3_MAX * scale)


_IDX = formats.INDEXER_FORMATS
CODECS: dict[str, Codec] = {c.fmt.name: c for c in (
    Codec(formats.FP8_DS_MLA, KV_WIDTH, _ds_mla_encode, _ds_mla_decode, POW2_FP8_MAX_ABS),
    Codec(formats.BF16_KV, KV_WIDTH, _bf16_encode, _bf16_decode, raw=True),
    uniform_fp8_codec(1.0),
    Codec(formats.UNIFIED_FP8_KV, KV_WIDTH, _unified_encode, _unified_decode, POW2_FP8_MAX_ABS),
    Codec(formats.V41_SWA_KV, KV_WIDTH, _v41_fp8_encode, _v41_fp8_decode, POW2_FP8_MAX_ABS),
    Codec(formats.V41_COMPRESSED_KV, KV_WIDTH, _v41_fp4_encode, _v41_fp4_decode,
          max_abs=nm.E2M1_MAX * nm.E4M3_MAX),
    Codec(_IDX["fp8"], INDEX_WIDTH, _index_fp8_encode, _index_fp8_decode, POW2_FP8_MAX_ABS),
    Codec(_IDX["fp4"], INDEX_WIDTH, _mxfp4_encode, _mxfp4_decode, MXFP4_MAX_ABS),
    Codec(_IDX["bf16"], INDEX_WIDTH, _bf16_encode, _bf16_decode, raw=True),
    _raw_codec(formats.FP32_KV, KV_WIDTH, torch.float32),
    _raw_codec(formats.FP64_KV, KV_WIDTH, torch.float64),
    _raw_codec(_IDX["fp32"], INDEX_WIDTH, torch.float32),
    _raw_codec(_IDX["fp64"], INDEX_WIDTH, torch.float64),
)}


def codec_for(fmt: formats.RowFormat, *, scale: float | None = None) -> Codec:
    """The codec of a row format; `scale` sets uniform fp8's per-pool scale."""
    from .errors import DataPathError
    if fmt.name not in CODECS:
        raise DataPathError("format", f"no codec for {fmt.name!r}", f"use one of {', '.join(CODECS)}")
    if scale is not None:
        if fmt.name != formats.UNIFORM_FP8_KV.name:
            raise DataPathError("scale", f"{fmt.name} keeps its scales in the row", "leave scale unset")
        if not scale > 0:
            raise DataPathError("scale", f"{scale!r} is not positive", "give a positive pool scale")
        return uniform_fp8_codec(scale)
    return CODECS[fmt.name]
