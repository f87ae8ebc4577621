"""Triton store/gather for fp8_ds_mla and the fp8 indexer: same bytes as the torch codecs.

Numerics mirror `numerics.py` bit for bit: the power-of-two exponent comes from the integer bits
of the tile amax, scaling is an exact multiply by 2^(127-e), and the fp8 encoding rounds to
nearest even after clamping to ±448, done with integer ops (`e4m3_rne`) so it does not depend on
how a backend lowers the cast (checked under TRITON_INTERPRET=1 on CPU, where the cast differs).
One program handles BT tokens of one layer; grid axis 1 covers a range of layers so a decode
step's layers go in one launch. Imported only on first use (CUDA, triton present) or by the tests.
"""

from __future__ import annotations

import os

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


# On a GPU the hardware conversion (cvt.rn.satfinite) rounds to nearest even, as torch does; the
# integer path costs ~15 int32 ops per element and made the store compute-bound (measured on the
# H200: 0.57 of copy bandwidth). Triton's CPU interpreter does not round its fp8 casts to nearest,
# so it keeps the integer path. TRITON_INTERPRET is Triton's own global switch, read once here.
HW_CAST = os.environ.get("TRITON_INTERPRET", "0") != "1"


@triton.jit
def _to_e4m3(y, HW: tl.constexpr):
    """fp32 already clamped to ±448 → e4m3fn byte, round to nearest even."""
    if HW:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return e4m3_rne(y)


@triton.jit
def _tokens(slots_ptr, n, buf_ptr, b_su, b_sl, layer0, P: tl.constexpr, BT: tl.constexpr):
    """BT tokens of one layer per program: the slots, each token's page base and in-page offset.
    Several tokens per program keep more bytes in flight than one small row per program."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = t < n
    slot = tl.load(slots_ptr + t, mask=ok, other=0).to(tl.int64)
    layer = (layer0 + tl.program_id(1)).to(tl.int64)
    return t.to(tl.int64), ok, buf_ptr + (slot // P) * b_su + layer * b_sl, slot % P


@triton.jit
def _ds_mla_store(val_ptr, v_sl, v_sn, buf_ptr, b_su, b_sl, slots_ptr, n, layer0, P: tl.constexpr, scale_region,
                  NOPE: tl.constexpr, ROPE: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr,
                  DATA: tl.constexpr, SCALE: tl.constexpr, Q_EXP: tl.constexpr, Q_MANT: tl.constexpr,
                  BT: tl.constexpr, HW: tl.constexpr):
    t, ok, base, off = _tokens(slots_ptr, n, buf_ptr, b_su, b_sl, layer0, P, BT)
    row = val_ptr + tl.program_id(1).to(tl.int64) * v_sl + t * v_sn                  # [BT]
    ds_mla_store_rows(row, ok, base, off, scale_region, NOPE, ROPE, TILE, NT, DATA, SCALE, Q_EXP, Q_MANT, HW)


@triton.jit
def ds_mla_store_rows(row, ok, base, off, scale_region, NOPE: tl.constexpr, ROPE: tl.constexpr,
                      TILE: tl.constexpr, NT: tl.constexpr, DATA: tl.constexpr, SCALE: tl.constexpr,
                      Q_EXP: tl.constexpr, Q_MANT: tl.constexpr, HW: tl.constexpr):
    """Quantize the bf16 rows at `row` [BT] (masked by `ok`) into entries `off` of pages `base`.
    Both loads are issued before any store: a load after a store waits a second memory trip."""
    q, e, rope = _ds_mla_quantize(row, ok, NOPE, ROPE, TILE, NT, Q_EXP, Q_MANT, HW)
    _ds_mla_put(q, e, rope, ok, base, off, scale_region, NOPE, ROPE, TILE, NT, DATA, SCALE)


@triton.jit
def _ds_mla_lanes(ok, NOPE: tl.constexpr, ROPE: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr):
    """An fp8_ds_mla row's lanes for BT rows masked by `ok`: the tile numbers [NT], each tile
    element's offset [1, NT, TILE], the mask of the NOPE tiles [BT, NT, TILE], the rope lanes
    [1, ROPE]."""
    r = tl.arange(0, NT)
    c = tl.arange(0, TILE)
    idx = (r[:, None] * TILE + c[None, :])[None, :, :]
    m = ok[:, None, None] & (r < NOPE // TILE)[None, :, None]
    return r, idx, m, tl.arange(0, ROPE)[None, :]


@triton.jit
def _ds_mla_quantize(row, ok, NOPE: tl.constexpr, ROPE: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr,
                     Q_EXP: tl.constexpr, Q_MANT: tl.constexpr, HW: tl.constexpr):
    """The rows at `row` [BT] as stored: fp8 tiles [BT, NT, TILE], their exponents [BT, NT] and
    the rope part's bf16 bits [BT, ROPE]."""
    r, idx, m, k = _ds_mla_lanes(ok, NOPE, ROPE, TILE, NT)
    x = tl.load(row[:, None, None] + idx, mask=m, other=0.0).to(tl.float32)
    rope = tl.load(row.to(tl.pointer_type(tl.uint16))[:, None] + NOPE + k, mask=ok[:, None])  # bf16 bits
    amax = tl.maximum(tl.max(tl.abs(x), axis=2), 1e-4)   # official act_quant floor on amax
    e = _e4m3_exponent(amax, Q_EXP, Q_MANT)                                          # [BT, NT]
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    q = _to_e4m3(tl.minimum(tl.maximum(x * inv[:, :, None], -448.0), 448.0), HW)
    return q, e, rope


@triton.jit
def _ds_mla_put(q, e, rope, ok, base, off, scale_region, NOPE: tl.constexpr, ROPE: tl.constexpr,
                TILE: tl.constexpr, NT: tl.constexpr, DATA: tl.constexpr, SCALE: tl.constexpr):
    r, idx, m, k = _ds_mla_lanes(ok, NOPE, ROPE, TILE, NT)
    data = base + off * DATA
    tl.store(data[:, None, None] + idx, q, mask=m)
    tl.store((data + NOPE).to(tl.pointer_type(tl.uint16))[:, None] + k, rope, mask=ok[:, None])
    sc = (base + scale_region + off * SCALE)[:, None] + r[None, :]
    tl.store(sc, tl.where((r < NOPE // TILE)[None, :], e, 0).to(tl.uint8), mask=ok[:, None])


@triton.jit
def _ds_mla_values(q, e):
    """Stored tiles and exponents as the values a read returns (fp32 [BT, NT, TILE])."""
    scale = (e << 23).to(tl.float32, bitcast=True)                   # byte 0 reads as 0
    return q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]


@triton.jit
def _ds_mla_take(ok, base, off, scale_region, NOPE: tl.constexpr, ROPE: tl.constexpr, TILE: tl.constexpr,
                 NT: tl.constexpr, DATA: tl.constexpr, SCALE: tl.constexpr):
    """The entries `off` of pages `base` (masked by `ok`) as values [BT, NT, TILE] and rope bits."""
    r, idx, m, k = _ds_mla_lanes(ok, NOPE, ROPE, TILE, NT)
    data = base + off * DATA
    q = tl.load(data[:, None, None] + idx, mask=m, other=0)
    e = tl.load((base + scale_region + off * SCALE)[:, None] + r[None, :], mask=ok[:, None], other=0).to(tl.int32)
    rope = tl.load((data + NOPE).to(tl.pointer_type(tl.uint16))[:, None] + k, mask=ok[:, None])
    return _ds_mla_values(q, e), rope


@triton.jit
def _ds_mla_emit(row, y, rope, ok, NOPE: tl.constexpr, ROPE: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr):
    r, idx, m, k = _ds_mla_lanes(ok, NOPE, ROPE, TILE, NT)
    tl.store(row[:, None, None] + idx, y.to(tl.bfloat16), mask=m)
    tl.store(row.to(tl.pointer_type(tl.uint16))[:, None] + NOPE + k, rope, mask=ok[:, None])


@triton.jit
def _ds_mla_gather(out_ptr, o_sl, o_sn, buf_ptr, b_su, b_sl, slots_ptr, n, layer0, P: tl.constexpr, scale_region,
                   NOPE: tl.constexpr, ROPE: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr,
                   DATA: tl.constexpr, SCALE: tl.constexpr, BT: tl.constexpr):
    t, ok, base, off = _tokens(slots_ptr, n, buf_ptr, b_su, b_sl, layer0, P, BT)
    row = out_ptr + tl.program_id(1).to(tl.int64) * o_sl + t * o_sn
    y, rope = _ds_mla_take(ok, base, off, scale_region, NOPE, ROPE, TILE, NT, DATA, SCALE)
    _ds_mla_emit(row, y, rope, ok, NOPE, ROPE, TILE, NT)


@triton.jit
def _ds_mla_swa_step(val_ptr, out_ptr, o_sn, buf_ptr, b_su, b_sl, slots_ptr, n, layer0, P: tl.constexpr,
                     scale_region, NOPE: tl.constexpr, ROPE: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr,
                     DATA: tl.constexpr, SCALE: tl.constexpr, Q_EXP: tl.constexpr, Q_MANT: tl.constexpr,
                     BT: tl.constexpr, HW: tl.constexpr):
    """One decode step of one request's window in one launch: the row at `val_ptr` is stored at
    the last of the `n` slots, and the n entries are read into `out`, the last from the row as
    quantized in registers (what a read of it returns, bit for bit) rather than from memory, so
    no program reads what another writes."""
    t, ok, base, off = _tokens(slots_ptr, n, buf_ptr, b_su, b_sl, layer0, P, BT)
    new = t == n - 1
    old = ok & ~new
    y, rope = _ds_mla_take(old, base, off, scale_region, NOPE, ROPE, TILE, NT, DATA, SCALE)
    q, e, rope_new = _ds_mla_quantize(val_ptr + t * 0, new, NOPE, ROPE, TILE, NT, Q_EXP, Q_MANT, HW)
    _ds_mla_put(q, e, rope_new, new, base, off, scale_region, NOPE, ROPE, TILE, NT, DATA, SCALE)
    y = tl.where(new[:, None, None], _ds_mla_values(q, e), y)
    rope = tl.where(new[:, None], rope_new, rope)
    _ds_mla_emit(out_ptr + t * o_sn, y, rope, ok, NOPE, ROPE, TILE, NT)


@triton.jit
def _index_fp8_store(val_ptr, v_sl, v_sn, buf_ptr, b_su, b_sl, slots_ptr, n, layer0, P: tl.constexpr, scale_region,
                     WIDTH: tl.constexpr, DATA: tl.constexpr, SCALE: tl.constexpr,
                     Q_EXP: tl.constexpr, Q_MANT: tl.constexpr, BT: tl.constexpr, HW: tl.constexpr):
    t, ok, base, off = _tokens(slots_ptr, n, buf_ptr, b_su, b_sl, layer0, P, BT)
    row = val_ptr + tl.program_id(1).to(tl.int64) * v_sl + t * v_sn
    k = tl.arange(0, WIDTH)[None, :]
    x = tl.load(row[:, None] + k, mask=ok[:, None], other=0.0).to(tl.float32)
    e = _e4m3_exponent(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4), Q_EXP, Q_MANT)   # [BT]
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    q = _to_e4m3(tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0), HW)
    tl.store((base + off * DATA)[:, None] + k, q, mask=ok[:, None])
    scale = (e << 23).to(tl.float32, bitcast=True)   # stored as a plain fp32 scale
    tl.store((base + scale_region + off * SCALE).to(tl.pointer_type(tl.float32)), scale, mask=ok)


@triton.jit
def _index_fp8_gather(out_ptr, o_sl, o_sn, buf_ptr, b_su, b_sl, slots_ptr, n, layer0, P: tl.constexpr, scale_region,
                      WIDTH: tl.constexpr, DATA: tl.constexpr, SCALE: tl.constexpr, BT: tl.constexpr):
    t, ok, base, off = _tokens(slots_ptr, n, buf_ptr, b_su, b_sl, layer0, P, BT)
    row = out_ptr + tl.program_id(1).to(tl.int64) * o_sl + t * o_sn
    k = tl.arange(0, WIDTH)[None, :]
    q = tl.load((base + off * DATA)[:, None] + k, mask=ok[:, None], other=0)
    scale = tl.load((base + scale_region + off * SCALE).to(tl.pointer_type(tl.float32)), mask=ok, other=0.0)
    y = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
    tl.store(row[:, None] + k, y.to(tl.bfloat16), mask=ok[:, None])


# tokens per program and warps, per kernel: set from bench/datapath_tune.py on an H200
CONFIG = {"ds_mla_store": (32, 8), "ds_mla_gather": (4, 2), "index_store": (16, 4), "index_gather": (8, 4)}
# one layer per launch (how an engine calls it, layer by layer) has 1/43 of the programs of the
# tuned multi-layer launch, so fewer tokens per program: from bench/datapath_layer_gpu.py on an
# H200 (a 1,024-token decode step). A one-layer prefill chunk has programs enough again: rows of
# 8 tokens and 4 warps per program (the fused write's SWA rows, same code) stored 8,192 tokens at
# 0.84 of copy bandwidth, 1 and 1 at 0.56 (bench/RESULTS.md, issue 15).
CONFIG_ONE_LAYER = {"ds_mla_store": (1, 1), "ds_mla_gather": (4, 4),
                    "index_store": (4, 4), "index_gather": (4, 4)}
CONFIG_ONE_LAYER_CHUNK = {"ds_mla_store": (8, 4)}
CHUNK_TOKENS = 4096


def _config(name: str, layers: range, tokens: int):
    if len(layers) > 1:
        return CONFIG[name]
    if tokens >= CHUNK_TOKENS and name in CONFIG_ONE_LAYER_CHUNK:
        return CONFIG_ONE_LAYER_CHUNK[name]
    return CONFIG_ONE_LAYER[name]


def _common(geom, buffer, layers: range, slots):
    if buffer.stride(2) != 1:
        raise ValueError("pool buffer must be contiguous along its page bytes")
    return (buffer, buffer.stride(0), buffer.stride(1), slots.contiguous(), slots.numel(), layers.start,
            geom.entries, geom.scale_region)


# Launches past triton's per-call dispatch (binding, specialization and cache-key strings: about
# 13 of the 19 us a launch costs the host on an H200 machine, where the model that calls a layer's
# store and gather a dozen times a step is launch-bound). A kernel is compiled and launched the
# first time through triton for each specialization key below, which refines triton's own (16-byte
# alignment of every tensor, and of each int: 1, a multiple of 16, 32 or 64 bits), and launched
# straight through its compiled launcher after. Only on the Triton line this was checked on (the
# launcher's arguments are triton's internals), without launch hooks, and unless
# KVATLAS_TRITON_DIRECT=0.
DIRECT = (HW_CAST and triton.__version__.startswith("3.6.")
          and os.environ.get("KVATLAS_TRITON_DIRECT", "1") != "0")


def _key(a):
    if type(a) is int:
        return (a == 1, a % 16 == 0, -2**31 <= a < 2**31)
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    return (type(a), a)


def _hooked() -> bool:
    rt = triton.knobs.runtime
    return bool(getattr(rt.launch_enter_hook, "calls", rt.launch_enter_hook)
                or getattr(rt.launch_exit_hook, "calls", rt.launch_exit_hook))


def _stream() -> int:
    """The current CUDA stream of the current device, as triton's driver finds it (torch's
    calls, without the Python wrappers around them once CUDA is initialised)."""
    if _RAW is not None:
        return _RAW[0](_RAW[1]())
    drv = triton.runtime.driver.active
    return drv.get_current_stream(drv.get_current_device())


_RAW = ((torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice)
        if hasattr(torch._C, "_cuda_getCurrentRawStream") and hasattr(torch._C, "_cuda_getDevice") else None)


class Launch:
    """One kernel with its meta-parameters fixed (constexprs and num_warps): `launch(grid, *args)`
    with the kernel's leading, non-constexpr arguments."""

    __slots__ = ("fn", "meta", "tail", "compiled")

    def __init__(self, fn, **meta) -> None:
        self.fn, self.meta = fn, meta
        self.tail: tuple | None = None
        self.compiled: dict = {}

    def __call__(self, grid, *args, key=None) -> None:
        """`key`: the specialization key of `args` when the caller made it (it must be what
        `tuple(map(_key, args))` is, or finer)."""
        if not DIRECT or _hooked():
            self.fn[grid](*args, **self.meta)
            return
        if key is None:
            key = tuple(map(_key, args))
        ck = self.compiled.get(key)
        if ck is None:
            self.compiled[key] = self.fn[grid](*args, **self.meta)
            return
        if self.tail is None:   # the constexprs in the kernel's order, after the leading arguments
            self.tail = tuple(self.meta[n] for n in self.fn.arg_names[len(args):])
        ck.run(grid[0], grid[1], 1, _stream(), ck.function, ck.packed_metadata, None, None, None, *args, *self.tail)


_LAUNCHES: dict = {}


def _launch(fn, bt: int, warps: int, geom, **const) -> Launch:
    key = (fn, bt, warps, geom.fmt.data_bytes, geom.fmt.scale_bytes)
    got = _LAUNCHES.get(key)
    if got is None:
        got = _LAUNCHES[key] = Launch(fn, DATA=geom.fmt.data_bytes, SCALE=geom.fmt.scale_bytes, BT=bt,
                                      num_warps=warps, **const)
    return got


def _store_launch(codec, geom, layers: range, n: int):
    if codec.fmt.name == "fp8_ds_mla":
        bt, warps = _config("ds_mla_store", layers, n)
        return bt, _launch(_ds_mla_store, bt, warps, geom, NOPE=NOPE, ROPE=ROPE, TILE=DS_MLA_TILE, NT=8,
                           Q_EXP=_E4M3_EXP, Q_MANT=_Q_MANT, HW=HW_CAST)
    bt, warps = _config("index_store", layers, n)
    return bt, _launch(_index_fp8_store, bt, warps, geom, WIDTH=INDEX_WIDTH, Q_EXP=_E4M3_EXP, Q_MANT=_Q_MANT,
                       HW=HW_CAST)


def _gather_launch(codec, geom, layers: range, n: int):
    if codec.fmt.name == "fp8_ds_mla":
        bt, warps = _config("ds_mla_gather", layers, n)
        return bt, _launch(_ds_mla_gather, bt, warps, geom, NOPE=NOPE, ROPE=ROPE, TILE=DS_MLA_TILE, NT=8)
    bt, warps = _config("index_gather", layers, n)
    return bt, _launch(_index_fp8_gather, bt, warps, geom, WIDTH=INDEX_WIDTH)


def _step_launch(codec, geom, layers: range, n: int):
    bt, warps = _config("ds_mla_gather", layers, n)
    return bt, _launch(_ds_mla_swa_step, bt, warps, geom, NOPE=NOPE, ROPE=ROPE, TILE=DS_MLA_TILE, NT=8,
                       Q_EXP=_E4M3_EXP, Q_MANT=_Q_MANT, HW=HW_CAST)


def store(codec, geom, buffer, layers: range, slots, values) -> None:
    vals = values.to(torch.bfloat16).contiguous()          # [L, n, width]
    bt, launch = _store_launch(codec, geom, layers, slots.numel())
    launch((triton.cdiv(vals.shape[1], bt), vals.shape[0]), vals, vals.stride(0), vals.stride(1),
           *_common(geom, buffer, layers, slots))


def gather(codec, geom, buffer, layers: range, slots):
    out = torch.empty((len(layers), slots.numel(), codec.width), dtype=torch.bfloat16, device=buffer.device)
    if slots.numel() == 0:
        return out
    bt, launch = _gather_launch(codec, geom, layers, slots.numel())
    launch((triton.cdiv(slots.numel(), bt), len(layers)), out, out.stride(0), out.stride(1),
           *_common(geom, buffer, layers, slots))
    return out


class LayerOps:
    """store and gather of one layer of one pool with everything fixed made once: what a caller
    that writes and reads a layer a few times a step (the transformers adapter) calls instead of
    `paged.store`/`gather`. Slots: int64, 1-D, contiguous, on the buffer's device; values
    [n, width]. With `layers` > 1, gather reads those consecutive layers from `layer` on in one
    launch (store and step are one layer's)."""

    __slots__ = ("codec", "geom", "layers", "fixed", "tail", "fixed_key", "width", "device", "made")

    def __init__(self, codec, geom, buffer, layer: int, layers: int = 1) -> None:
        if buffer.stride(2) != 1:
            raise ValueError("pool buffer must be contiguous along its page bytes")
        if not (layers >= 1 and 0 <= layer and layer + layers <= buffer.shape[1]):
            raise ValueError(f"layers {layer}..{layer + layers - 1} outside the buffer's {buffer.shape[1]}")
        self.codec, self.geom, self.layers = codec, geom, range(layer, layer + layers)
        self.fixed = (buffer, buffer.stride(0), buffer.stride(1))
        self.tail = (layer, geom.entries, geom.scale_region)
        # the key of the arguments that never change, made once: each launch keys only its own
        self.fixed_key = (tuple(map(_key, self.fixed)), tuple(map(_key, self.tail)))
        self.width, self.device = codec.width, buffer.device
        self.made: dict = {}   # (op, a chunk's size or not): (tokens a program, Launch)

    def _made(self, op: str, n: int):
        key = (op, n >= CHUNK_TOKENS)
        got = self.made.get(key)
        if got is None:
            if op != "gather" and len(self.layers) > 1:   # never made, so checked at every such call
                raise ValueError(f"LayerOps.{op} writes one layer; this one reads {len(self.layers)}")
            got = self.made[key] = {"store": _store_launch, "gather": _gather_launch, "step": _step_launch}[op](
                self.codec, self.geom, self.layers, n)
        return got

    @property
    def steps(self) -> bool:
        """Whether `step` is there (fp8_ds_mla: the SWA's format in the fp8 layout)."""
        return self.codec.fmt.name == "fp8_ds_mla"

    def step(self, slots, row, shape=None):
        """One request's decode step on a window in one launch: `row` (width values, any shape)
        stored at the last of `slots` (1-D, n), and the n entries read back, [n, width] or `shape`
        — the same bytes and the same values as `store` of the row then `gather` of the slots.
        The new slot must not be among the others (a window's slots are distinct)."""
        n = slots.numel()
        out = torch.empty(shape or (n, self.width), dtype=torch.bfloat16, device=self.device)
        if row.dtype != torch.bfloat16 or not row.is_contiguous():
            row = row.to(torch.bfloat16).contiguous()
        bt, launch = self._made("step", n)
        launch((triton.cdiv(n, bt), 1), row, out, self.width, *self.fixed, slots, n, *self.tail,
               key=(_key(row), _key(out), self.fixed_key, _key(slots), _key(n)))
        return out

    def store(self, slots, values) -> None:
        n = slots.numel()
        if not n:
            return
        if values.dtype != torch.bfloat16 or not values.is_contiguous():
            values = values.to(torch.bfloat16).contiguous()
        bt, launch = self._made("store", n)
        vs = values.stride(0)
        launch((triton.cdiv(n, bt), 1), values, 0, vs, *self.fixed, slots, n, *self.tail,
               key=self._key(values, 0, vs, slots, n))

    def gather(self, slots, shape=None):
        """The entries of `slots` (1-D, n): [n, width] (one layer) or [layers, n, width], or
        `shape` (of as many values, in that order)."""
        n, layers = slots.numel(), len(self.layers)
        out = torch.empty(shape or ((n, self.width) if layers == 1 else (layers, n, self.width)),
                          dtype=torch.bfloat16, device=self.device)
        if n:
            bt, launch = self._made("gather", n)
            ls = 0 if layers == 1 else n * self.width
            launch((triton.cdiv(n, bt), layers), out, ls, self.width, *self.fixed, slots, n, *self.tail,
                   key=self._key(out, ls, self.width, slots, n))
        return out

    def _key(self, rows, layer_stride: int, row_stride: int, slots, n: int) -> tuple:
        """The specialization key of a launch's arguments (`Launch`): the rows tensor, its layer
        and row strides, the fixed ones, the slots, n."""
        return (_key(rows), _key(layer_stride), _key(row_stride), self.fixed_key, _key(slots), _key(n))
