"""Triton store/gather for fp8_ds_mla and the fp8 indexer: same bytes as the torch codecs.

Numerics mirror `numerics.py` bit for bit: the power-of-two exponent comes from the integer bits
of the tile amax, scaling is an exact multiply by 2^(127-e), and the fp8 encoding rounds to
nearest even after clamping to ±448, done with integer ops (`e4m3_rne`) so it does not depend on
how a backend lowers the cast (checked under TRITON_INTERPRET=1 on CPU, where the cast differs).
One program handles one (token, layer); grid axis 1 covers a range of layers so a decode step's
layers go in one launch. Imported only on first use (CUDA, triton present) or by the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import numerics as nm
from ..codecs import DS_MLA_TILE, INDEX_WIDTH, NOPE, ROPE

_Q_EXP, _Q_MANT = nm.float_fields(nm.E4M3_MAX)
_E4M3_EXP = _Q_EXP - nm.EXP_BIAS   # 448 = 1.75 * 2^8


@triton.jit
def _e4m3_exponent(amax, Q_EXP: tl.constexpr, Q_MANT: tl.constexpr):
    bits = amax.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - Q_EXP + ((bits & 0x7FFFFF) > Q_MANT).to(tl.int32)


@triton.jit
def e4m3_rne(y):
    """fp32 (|y| <= 448) -> e4m3fn byte, round half to even, with integer ops only: the same bytes
    as torch's cast on any backend (Triton's interpreter does not round fp8 casts to nearest)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.uint8)
    mag = bits & 0x7FFFFFFF
    # normal range: round the fp32 mantissa to 3 bits; a carry bumps the exponent, as it should
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # subnormal range (|y| < 2^-6): the code is round(|y| · 2^9), exact in fp32
    v = tl.abs(y) * 512.0
    k = v.to(tl.int32)
    frac = v - k.to(tl.float32)
    k = k + ((frac > 0.5) | ((frac == 0.5) & ((k & 1) == 1))).to(tl.int32)
    code = tl.where(mag < 0x3C800000, k, normal)       # 0x3C800000 = 2^-6, the smallest normal
    return code.to(tl.uint8) | sign


@triton.jit
def _slot_base(buf_ptr, slots_ptr, b_su, b_sl, layer0, P):
    t = tl.program_id(0)
    layer = layer0 + tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    return buf_ptr + (slot // P) * b_su + layer.to(tl.int64) * b_sl, slot % P


@triton.jit
def _ds_mla_store(val_ptr, v_sl, v_sn, buf_ptr, b_su, b_sl, slots_ptr, layer0, P, scale_region,
                  NOPE: tl.constexpr, ROPE: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr,
                  DATA: tl.constexpr, SCALE: tl.constexpr, Q_EXP: tl.constexpr, Q_MANT: tl.constexpr):
    base, off = _slot_base(buf_ptr, slots_ptr, b_su, b_sl, layer0, P)
    row = val_ptr + tl.program_id(1).to(tl.int64) * v_sl + tl.program_id(0).to(tl.int64) * v_sn
    r = tl.arange(0, NT)
    c = tl.arange(0, TILE)
    nope = (r < NOPE // TILE)[:, None]
    x = tl.load(row + r[:, None] * TILE + c[None, :], mask=nope, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)   # official act_quant floor on amax
    e = _e4m3_exponent(amax, Q_EXP, Q_MANT)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    q = e4m3_rne(tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0))
    data = base + off * DATA
    tl.store(data + r[:, None] * TILE + c[None, :], q, mask=nope)
    k = tl.arange(0, ROPE)
    rope = tl.load(row.to(tl.pointer_type(tl.uint16)) + NOPE + k)   # the bf16 bits, untouched
    tl.store((data + NOPE).to(tl.pointer_type(tl.uint16)) + k, rope)
    tl.store(base + scale_region + off * SCALE + r, tl.where(r < NOPE // TILE, e, 0).to(tl.uint8))


@triton.jit
def _ds_mla_gather(out_ptr, o_sl, o_sn, buf_ptr, b_su, b_sl, slots_ptr, layer0, P, scale_region,
                   NOPE: tl.constexpr, ROPE: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr,
                   DATA: tl.constexpr, SCALE: tl.constexpr):
    base, off = _slot_base(buf_ptr, slots_ptr, b_su, b_sl, layer0, P)
    row = out_ptr + tl.program_id(1).to(tl.int64) * o_sl + tl.program_id(0).to(tl.int64) * o_sn
    r = tl.arange(0, NT)
    c = tl.arange(0, TILE)
    nope = (r < NOPE // TILE)[:, None]
    data = base + off * DATA
    q = tl.load(data + r[:, None] * TILE + c[None, :], mask=nope, other=0)
    e = tl.load(base + scale_region + off * SCALE + r).to(tl.int32)
    scale = (e << 23).to(tl.float32, bitcast=True)                   # byte 0 reads as 0
    y = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
    tl.store(row + r[:, None] * TILE + c[None, :], y.to(tl.bfloat16), mask=nope)
    k = tl.arange(0, ROPE)
    rope = tl.load((data + NOPE).to(tl.pointer_type(tl.uint16)) + k)
    tl.store(row.to(tl.pointer_type(tl.uint16)) + NOPE + k, rope)


@triton.jit
def _index_fp8_store(val_ptr, v_sl, v_sn, buf_ptr, b_su, b_sl, slots_ptr, layer0, P, scale_region,
                     WIDTH: tl.constexpr, DATA: tl.constexpr, SCALE: tl.constexpr,
                     Q_EXP: tl.constexpr, Q_MANT: tl.constexpr):
    base, off = _slot_base(buf_ptr, slots_ptr, b_su, b_sl, layer0, P)
    row = val_ptr + tl.program_id(1).to(tl.int64) * v_sl + tl.program_id(0).to(tl.int64) * v_sn
    k = tl.arange(0, WIDTH)
    x = tl.load(row + k).to(tl.float32)
    e = _e4m3_exponent(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-4), Q_EXP, Q_MANT)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    q = e4m3_rne(tl.minimum(tl.maximum(x * inv, -448.0), 448.0))
    tl.store(base + off * DATA + k, q)
    scale = (e << 23).to(tl.float32, bitcast=True)   # stored as a plain fp32 scale
    tl.store((base + scale_region + off * SCALE).to(tl.pointer_type(tl.float32)), scale)


@triton.jit
def _index_fp8_gather(out_ptr, o_sl, o_sn, buf_ptr, b_su, b_sl, slots_ptr, layer0, P, scale_region,
                      WIDTH: tl.constexpr, DATA: tl.constexpr, SCALE: tl.constexpr):
    base, off = _slot_base(buf_ptr, slots_ptr, b_su, b_sl, layer0, P)
    row = out_ptr + tl.program_id(1).to(tl.int64) * o_sl + tl.program_id(0).to(tl.int64) * o_sn
    k = tl.arange(0, WIDTH)
    q = tl.load(base + off * DATA + k)
    scale = tl.load((base + scale_region + off * SCALE).to(tl.pointer_type(tl.float32)))
    y = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
    tl.store(row + k, y.to(tl.bfloat16))


def _common(geom, buffer, layers: range, slots):
    if buffer.stride(2) != 1:
        raise ValueError("pool buffer must be contiguous along its page bytes")
    return (buffer, buffer.stride(0), buffer.stride(1), slots.contiguous(), layers.start,
            geom.entries, geom.scale_region)


def store(codec, geom, buffer, layers: range, slots, values) -> None:
    vals = values.to(torch.bfloat16).contiguous()          # [L, n, width]
    grid = (vals.shape[1], vals.shape[0])
    args = (vals, vals.stride(0), vals.stride(1), *_common(geom, buffer, layers, slots))
    if codec.fmt.name == "fp8_ds_mla":
        _ds_mla_store[grid](*args, NOPE=NOPE, ROPE=ROPE, TILE=DS_MLA_TILE, NT=8,
                            DATA=geom.fmt.data_bytes, SCALE=geom.fmt.scale_bytes,
                            Q_EXP=_E4M3_EXP, Q_MANT=_Q_MANT, num_warps=4)
    else:
        _index_fp8_store[grid](*args, WIDTH=INDEX_WIDTH, DATA=geom.fmt.data_bytes,
                               SCALE=geom.fmt.scale_bytes, Q_EXP=_E4M3_EXP, Q_MANT=_Q_MANT, num_warps=2)


def gather(codec, geom, buffer, layers: range, slots):
    out = torch.empty((len(layers), slots.numel(), codec.width), dtype=torch.bfloat16, device=buffer.device)
    if slots.numel() == 0:
        return out
    grid = (slots.numel(), len(layers))
    args = (out, out.stride(0), out.stride(1), *_common(geom, buffer, layers, slots))
    if codec.fmt.name == "fp8_ds_mla":
        _ds_mla_gather[grid](*args, NOPE=NOPE, ROPE=ROPE, TILE=DS_MLA_TILE, NT=8,
                             DATA=geom.fmt.data_bytes, SCALE=geom.fmt.scale_bytes, num_warps=4)
    else:
        _index_fp8_gather[grid](*args, WIDTH=INDEX_WIDTH, DATA=geom.fmt.data_bytes,
                                SCALE=geom.fmt.scale_bytes, num_warps=2)
    return out
