"""The fused per-layer write (`datapath.write.write_layer`): one kernel, programs in two groups.

    [pool programs: a fixed number, sharing the step's completed blocks
     | token programs: BT tokens each — SWA store, attention and indexer ring appends]

Completed blocks are listed (and counted) in the step's table: the pool programs read the count
on the device and take work items (block, TPI 64-channel tiles) for the KV and one item per
block for the indexer keys, striding by the number of pool programs. The launch's size depends
only on the token count, so a CUDA graph holds it and replays any step of that shape. Pool
programs come first: each is a chain of dependent loads (count, block, window rows), the long
pole of the launch. (A first version gave every token its own pooling programs that mostly did
nothing: 11,000 programs per C4 layer of a 1,024-request decode step, three times the copy time
of its bytes on an H200.)

Registers decide the speed here (Nsight Compute on the H200, bench/RESULTS.md): a C4 window held
as one [8, C] tile took 212 registers a thread, 2 programs an SM, and its reductions over rows
went through shared memory; as eight [C] rows (`_pool`) the whole C4 kernel takes 40 registers
and runs below the time of a copy of its bytes. The C128 window (128 rows) stays one tile.

Pooling follows `compressor.pool` operation by operation — max, exp (libdevice's expf, the
function CUDA's expf is), sum of pairs (w, w + W/2) repeated, IEEE division — and the launch turns
off mul-add fusion, so the pooled fp32 values, and so the stored bytes, equal the torch
reference's on the same GPU. Quantization mirrors `codec_triton` (shared helpers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..codecs import DS_MLA_TILE, INDEX_WIDTH, NOPE, ROPE
from .. import step as _rows
from . import codec_triton
from .codec_triton import HW_CAST, _E4M3_EXP, _Q_MANT, _e4m3_exponent, _to_e4m3, ds_mla_store_rows
from .compress_triton import _to_state, bf16_round

# rows of StepIndices.table, as constants a kernel may read
REQ, POS, FIRST, LAST, SWA = (tl.constexpr(getattr(_rows, k)) for k in ("REQ", "POS", "FIRST", "LAST", "SWA"))

# Per launch configuration, from bench/datapath_layer_gpu.py --tune on an H200 (a 1,024-request
# decode step): tokens per token program, warps, 64-channel tiles per KV work item and the most
# pool programs, for C4 windows (8 rows) and longer ones (C128). A C128 call of CHUNK_TOKENS or
# more (a prefill chunk) takes c128_chunk_bt tokens per token program: its kernel holds 255
# registers a thread, so fewer, larger token programs (8,192 tokens: 32.9 µs at 8, 42.9 at 2); the
# C4 kernel (40 registers) was slower so (93.5 µs at 8, 59.2 at 2).
CONFIG = {"swa_bt": 2, "num_warps": 4, "c4_tpi": 2, "pool_programs": 2048,
          "c128_bt": 2, "c128_warps": 4, "c128_tpi": 1, "c128_pool_programs": 512, "c128_chunk_bt": 8}
CHUNK_TOKENS = 4096


@triton.jit
def _halve(x, H: tl.constexpr, C: tl.constexpr):
    return tl.sum(tl.reshape(x, (2, H, C)), axis=0)   # row w + row w + H: one addition each


@triton.jit
def _tree_sum(x, W: tl.constexpr, C: tl.constexpr):
    """[W, C] -> [C] in `compressor.tree_sum`'s order (W a power of two, at most 256)."""
    if W >= 256:
        x = _halve(x, 128, C)
    if W >= 128:
        x = _halve(x, 64, C)
    if W >= 64:
        x = _halve(x, 32, C)
    if W >= 32:
        x = _halve(x, 16, C)
    if W >= 16:
        x = _halve(x, 8, C)
    if W >= 8:
        x = _halve(x, 4, C)
    if W >= 4:
        x = _halve(x, 2, C)
    if W >= 2:
        x = _halve(x, 1, C)
    return tl.reshape(x, (C,))


@triton.jit
def _exp(x, HW: tl.constexpr):
    """expf as CUDA's libm computes it (torch.exp on CUDA); the CPU interpreter has no libdevice."""
    if HW:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _t8(x0, x1, x2, x3, x4, x5, x6, x7):
    """`_tree_sum` of eight rows held apart: (w, w + 4), then (w, w + 2), then (w, w + 1)."""
    return ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7))


@triton.jit
def _window(t, p_end, first, req, w, ch, kv_ptr, kv_sn, sc_ptr, sc_sn, ape_ptr, st_ptr, st_s, st_r,
            RING: tl.constexpr, D: tl.constexpr, CD: tl.constexpr, RATIO: tl.constexpr, W: tl.constexpr,
            OVERLAP: tl.constexpr, HAS_APE: tl.constexpr):
    """Rows w [R] of the window ending at p_end, channels ch [C], as fp32 (kv, score) [R, C]: from
    this step's inputs (positions >= the run's first) or the ring (older); before position 0,
    kv 0 and score -inf (cleared)."""
    q = p_end - (W - 1) + w
    if OVERLAP:   # previous block's rows read [:D], current block's rows [D:] (overlap_transform)
        half = tl.where(w < RATIO, 0, D)
    else:
        half = w * 0
    col = half[:, None] + ch[None, :]
    in_b = (q >= first)[:, None] & (col >= 0)
    from_ring = ((q < first) & (q >= 0))[:, None] & (col >= 0)
    qc = tl.where(q >= 0, q, 0)
    src = tl.where(q >= first, t - (p_end - q), 0)
    kv_in = tl.load(kv_ptr + src[:, None] * kv_sn + col, mask=in_b, other=0.0).to(tl.float32)
    sc_in = tl.load(sc_ptr + src[:, None] * sc_sn + col, mask=in_b, other=0.0).to(tl.float32)
    if HAS_APE:
        sc_in += tl.load(ape_ptr + (qc % RATIO)[:, None] * CD + col, mask=in_b, other=0.0)
    srow = st_ptr + req * st_s + (qc % RING)[:, None] * st_r + col
    kv_st = tl.load(srow, mask=from_ring, other=0.0).to(tl.float32)             # cleared: kv 0
    sc_st = tl.load(srow + CD, mask=from_ring, other=float("-inf")).to(tl.float32)  # score -inf
    return tl.where(in_b, _to_state(kv_in, st_ptr), kv_st), tl.where(in_b, _to_state(sc_in, st_ptr), sc_st)


@triton.jit
def _row(t, p_end, first, req, k: tl.constexpr, ch, kv_ptr, kv_sn, sc_ptr, sc_sn, ape_ptr, st_ptr, st_s, st_r,
         RING: tl.constexpr, D: tl.constexpr, CD: tl.constexpr, RATIO: tl.constexpr, W: tl.constexpr,
         OVERLAP: tl.constexpr, HAS_APE: tl.constexpr):
    """Window row k alone, [C] each, as `_window` reads it; the row comes from one place, so one
    branch loads it (not two masked loads whose registers are both held)."""
    q = p_end - (W - 1) + k
    col = ch
    if OVERLAP and k >= RATIO:   # previous block's rows read [:D], current block's rows [D:]
        col = ch + D
    if q >= first:
        src = t - (p_end - q)
        kv = _to_state(tl.load(kv_ptr + src * kv_sn + col).to(tl.float32), st_ptr)
        sc = tl.load(sc_ptr + src * sc_sn + col).to(tl.float32)
        if HAS_APE:
            sc += tl.load(ape_ptr + (q % RATIO) * CD + col)
        sc = _to_state(sc, st_ptr)
    elif q >= 0:
        srow = st_ptr + req * st_s + (q % RING) * st_r + col
        kv = tl.load(srow).to(tl.float32)
        sc = tl.load(srow + CD).to(tl.float32)
    else:   # cleared: kv 0, score -inf
        kv = tl.zeros(ch.shape, tl.float32)
        sc = tl.full(ch.shape, float("-inf"), tl.float32)
    return kv, sc


@triton.jit
def _pool(idx_ptr, ld, t, p_end, ch, kv_ptr, kv_sn, sc_ptr, sc_sn, ape_ptr, st_ptr, st_s, st_r, RING: tl.constexpr,
          D: tl.constexpr, CD: tl.constexpr, RATIO: tl.constexpr, W: tl.constexpr, OVERLAP: tl.constexpr,
          HAS_APE: tl.constexpr, C: tl.constexpr, HW: tl.constexpr):
    """Channels `ch` of the entry of the block token t completes (`compressor.pool`'s operations).
    A C4 window (8 rows) is eight [C] rows, each loaded by one branch (input or ring), whose max,
    exp and tree stay within each thread: as one [8, C] tile its two masked loads per row held
    twice the registers and its reductions over rows went through shared memory (on the H200 a C4
    layer's pool programs alone took 18.5 µs, now 6.8). A longer window stays one [W, C] tile:
    split into eight [W/8, C] classes it took three times longer (bench/RESULTS.md, issue 15)."""
    first = tl.load(idx_ptr + FIRST * ld + t)
    req = tl.load(idx_ptr + REQ * ld + t)
    if W == 8:
        k0, s0 = _row(t, p_end, first, req, 0, ch, kv_ptr, kv_sn, sc_ptr, sc_sn, ape_ptr, st_ptr, st_s, st_r,
                      RING, D, CD, RATIO, W, OVERLAP, HAS_APE)
        k1, s1 = _row(t, p_end, first, req, 1, ch, kv_ptr, kv_sn, sc_ptr, sc_sn, ape_ptr, st_ptr, st_s, st_r,
                      RING, D, CD, RATIO, W, OVERLAP, HAS_APE)
        k2, s2 = _row(t, p_end, first, req, 2, ch, kv_ptr, kv_sn, sc_ptr, sc_sn, ape_ptr, st_ptr, st_s, st_r,
                      RING, D, CD, RATIO, W, OVERLAP, HAS_APE)
        k3, s3 = _row(t, p_end, first, req, 3, ch, kv_ptr, kv_sn, sc_ptr, sc_sn, ape_ptr, st_ptr, st_s, st_r,
                      RING, D, CD, RATIO, W, OVERLAP, HAS_APE)
        k4, s4 = _row(t, p_end, first, req, 4, ch, kv_ptr, kv_sn, sc_ptr, sc_sn, ape_ptr, st_ptr, st_s, st_r,
                      RING, D, CD, RATIO, W, OVERLAP, HAS_APE)
        k5, s5 = _row(t, p_end, first, req, 5, ch, kv_ptr, kv_sn, sc_ptr, sc_sn, ape_ptr, st_ptr, st_s, st_r,
                      RING, D, CD, RATIO, W, OVERLAP, HAS_APE)
        k6, s6 = _row(t, p_end, first, req, 6, ch, kv_ptr, kv_sn, sc_ptr, sc_sn, ape_ptr, st_ptr, st_s, st_r,
                      RING, D, CD, RATIO, W, OVERLAP, HAS_APE)
        k7, s7 = _row(t, p_end, first, req, 7, ch, kv_ptr, kv_sn, sc_ptr, sc_sn, ape_ptr, st_ptr, st_s, st_r,
                      RING, D, CD, RATIO, W, OVERLAP, HAS_APE)
        m = tl.maximum(tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3)),
                       tl.maximum(tl.maximum(s4, s5), tl.maximum(s6, s7)))
        e0, e1, e2, e3 = _exp(s0 - m, HW), _exp(s1 - m, HW), _exp(s2 - m, HW), _exp(s3 - m, HW)
        e4, e5, e6, e7 = _exp(s4 - m, HW), _exp(s5 - m, HW), _exp(s6 - m, HW), _exp(s7 - m, HW)
        num = _t8(e0 * k0, e1 * k1, e2 * k2, e3 * k3, e4 * k4, e5 * k5, e6 * k6, e7 * k7)
        return tl.div_rn(num, _t8(e0, e1, e2, e3, e4, e5, e6, e7))
    else:
        kv, sc = _window(t, p_end, first, req, tl.arange(0, W), ch, kv_ptr, kv_sn, sc_ptr, sc_sn, ape_ptr, st_ptr,
                         st_s, st_r, RING, D, CD, RATIO, W, OVERLAP, HAS_APE)
        e = _exp(sc - tl.max(sc, axis=0)[None, :], HW)
        return tl.div_rn(_tree_sum(e * kv, W, C), _tree_sum(e, W, C))


@triton.jit
def _append(idx_ptr, ld, t, ok, kv_ptr, kv_sn, sc_ptr, sc_sn, ape_ptr, st_ptr, st_s, st_r, RING: tl.constexpr,
            CD: tl.constexpr, RATIO: tl.constexpr, HAS_APE: tl.constexpr):
    """Ring rows of tokens t [TB]: kv, then score + ape, through the state dtype. The input rows
    are loaded whether kept or not (masked by `ok` alone), so their loads do not wait for the
    position loads that decide it."""
    p = tl.load(idx_ptr + POS * ld + t, mask=ok, other=0)
    last = tl.load(idx_ptr + LAST * ld + t, mask=ok, other=0)
    req = tl.load(idx_ptr + REQ * ld + t, mask=ok, other=0)
    cols = tl.arange(0, CD)[None, :]
    m_in = ok[:, None] & (cols >= 0)
    kv = tl.load(kv_ptr + t[:, None] * kv_sn + cols, mask=m_in, other=0.0).to(tl.float32)
    sc = tl.load(sc_ptr + t[:, None] * sc_sn + cols, mask=m_in, other=0.0).to(tl.float32)
    if HAS_APE:
        sc += tl.load(ape_ptr + (p % RATIO)[:, None] * CD + cols, mask=m_in, other=0.0)
    m = (ok & (p > last - RING))[:, None] & (cols >= 0)   # a long run keeps its last RING rows
    row = st_ptr + req[:, None] * st_s + (p % RING)[:, None] * st_r + cols
    tl.store(row, _to_state(kv, st_ptr).to(st_ptr.dtype.element_ty), mask=m)
    tl.store(row + CD, _to_state(sc, st_ptr).to(st_ptr.dtype.element_ty), mask=m)


@triton.jit
def _ds_mla_tiles(x, c0, data, scale, TPI: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr,
                  Q_EXP: tl.constexpr, Q_MANT: tl.constexpr, HW: tl.constexpr):
    """Tiles c0 .. c0 + TPI - 1 of a pooled entry (x: [TPI·TILE]), rounded to bf16: a nope tile as
    fp8 + its exponent byte, the rope tile (NT) as bf16 bits and 0 for the pad byte after the
    exponents — `codecs._ds_mla_encode` for a whole entry (TPI 8) or one tile (TPI 1)."""
    x = tl.reshape(bf16_round(x), (TPI, TILE))
    r = c0 + tl.arange(0, TPI)
    k = tl.arange(0, TILE)[None, :]
    e = _e4m3_exponent(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4), Q_EXP, Q_MANT)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    q = _to_e4m3(tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0), HW)
    tl.store(data + r[:, None] * TILE + k, q, mask=(r < NT)[:, None] & (k >= 0))
    bits = (x.to(tl.int32, bitcast=True) >> 16).to(tl.uint16)
    rope = (data + NT * TILE).to(tl.pointer_type(tl.uint16))
    tl.store(rope + (r - NT)[:, None] * TILE + k, bits, mask=(r == NT)[:, None] & (k >= 0))
    tl.store(scale + r, tl.where(r < NT, e, 0).to(tl.uint8))


@triton.jit
def _index_tile(x, data, scale, WIDTH: tl.constexpr, Q_EXP: tl.constexpr, Q_MANT: tl.constexpr,
                HW: tl.constexpr):
    x = bf16_round(x)
    e = _e4m3_exponent(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-4), Q_EXP, Q_MANT)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    tl.store(data + tl.arange(0, WIDTH), _to_e4m3(tl.minimum(tl.maximum(x * inv, -448.0), 448.0), HW))
    tl.store(scale.to(tl.pointer_type(tl.float32)), (e << 23).to(tl.float32, bitcast=True))


@triton.jit
def _kv_item(idx_ptr, ld, i, DONE_ROW, E_ROW, kv_ptr, kv_sn, sc_ptr, sc_sn, ape_ptr, st_ptr, st_s, st_r,
             RING: tl.constexpr, c_buf, c_su, c_P: tl.constexpr, c_sr, RATIO: tl.constexpr, W: tl.constexpr,
             OVERLAP: tl.constexpr, CD: tl.constexpr, HAS_APE: tl.constexpr, D: tl.constexpr,
             TILE: tl.constexpr, NT: tl.constexpr, TPI: tl.constexpr, DATA: tl.constexpr, SCALE: tl.constexpr,
             Q_EXP: tl.constexpr, Q_MANT: tl.constexpr, HW: tl.constexpr):
    """Work item i of the attention KV: TPI 64-channel tiles of one completed block (a whole C4
    entry: its 8-row window is small; one tile of a C128 entry: its window has 128 rows)."""
    IPB: tl.constexpr = (NT + 1) // TPI
    t = tl.load(idx_ptr + DONE_ROW * ld + i // IPB)
    c0 = (i % IPB) * TPI
    ent = tl.load(idx_ptr + E_ROW * ld + t)
    out = _pool(idx_ptr, ld, t, tl.load(idx_ptr + POS * ld + t), c0 * TILE + tl.arange(0, TPI * TILE), kv_ptr,
                kv_sn, sc_ptr, sc_sn, ape_ptr, st_ptr, st_s, st_r, RING, D, CD, RATIO, W, OVERLAP, HAS_APE,
                TPI * TILE, HW)
    base = c_buf + (ent // c_P) * c_su
    _ds_mla_tiles(out, c0, base + (ent % c_P) * DATA, base + c_sr + (ent % c_P) * SCALE, TPI, TILE, NT,
                  Q_EXP, Q_MANT, HW)


@triton.jit
def _index_item(idx_ptr, ld, j, DONE_ROW, IE_ROW, kv_ptr, kv_sn, sc_ptr, sc_sn, ape_ptr, st_ptr, st_s, st_r,
                RING: tl.constexpr, x_buf, x_su, x_P: tl.constexpr, x_sr, RATIO: tl.constexpr, W: tl.constexpr,
                OVERLAP: tl.constexpr, HAS_APE: tl.constexpr, ID: tl.constexpr, IDATA: tl.constexpr,
                ISCALE: tl.constexpr, Q_EXP: tl.constexpr, Q_MANT: tl.constexpr, HW: tl.constexpr):
    """Work item j of the indexer: the j-th completed block's key."""
    t = tl.load(idx_ptr + DONE_ROW * ld + j)
    ent = tl.load(idx_ptr + IE_ROW * ld + t)
    out = _pool(idx_ptr, ld, t, tl.load(idx_ptr + POS * ld + t), tl.arange(0, ID), kv_ptr, kv_sn, sc_ptr, sc_sn,
                ape_ptr, st_ptr, st_s, st_r, RING, ID, 2 * ID, RATIO, W, OVERLAP, HAS_APE, ID, HW)
    base = x_buf + (ent // x_P) * x_su
    _index_tile(out, base + (ent % x_P) * IDATA, base + x_sr + (ent % x_P) * ISCALE, ID, Q_EXP, Q_MANT, HW)


@triton.jit
def _write_layer(idx_ptr, ld, n, cnt_ptr,
                 sw_val, sw_vsn, sw_buf, sw_su, sw_P: tl.constexpr, sw_sr,
                 kv_ptr, kv_sn, sc_ptr, sc_sn, ape_ptr, st_ptr, st_s, st_r, RING: tl.constexpr, c_buf, c_su,
                 c_P: tl.constexpr, c_sr, E_ROW,
                 ikv_ptr, ikv_sn, isc_ptr, isc_sn, iape_ptr, ist_ptr, ist_s, ist_r, IRING: tl.constexpr, x_buf, x_su,
                 x_P: tl.constexpr, x_sr,
                 IE_ROW, DONE_ROW, end_tok, n_pool, do_swa, do_app,
                 HAS_CMP: tl.constexpr, RATIO: tl.constexpr, W: tl.constexpr, OVERLAP: tl.constexpr,
                 CD: tl.constexpr, HAS_APE: tl.constexpr, HAS_IDX: tl.constexpr, HAS_IAPE: tl.constexpr,
                 D: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr, DATA: tl.constexpr, SCALE: tl.constexpr,
                 ID: tl.constexpr, IDATA: tl.constexpr, ISCALE: tl.constexpr, ROPE_W: tl.constexpr,
                 Q_EXP: tl.constexpr, Q_MANT: tl.constexpr, BT: tl.constexpr, HW: tl.constexpr,
                 TPI: tl.constexpr):
    """Programs [0, n_pool) share the completed blocks' work items, (block, TPI 64-channel tiles)
    for the KV and one per block for the indexer keys, as many as the device-side count says;
    then end_tok programs of BT tokens each (SWA store, ring appends)."""
    pid = tl.program_id(0)
    if pid < n_pool:   # pool programs first: theirs are the long chains of dependent loads
        cnt = tl.load(cnt_ptr).to(tl.int32)
        kv_items = cnt * 0
        if HAS_CMP:
            kv_items = cnt * ((NT + 1) // TPI)
        total = kv_items
        if HAS_IDX:
            total = kv_items + cnt
        i = pid
        while i < total:   # (a while loop: the CPU interpreter cannot range() over device scalars)
            if i < kv_items:
                if HAS_CMP:
                    _kv_item(idx_ptr, ld, i, DONE_ROW, E_ROW, kv_ptr, kv_sn, sc_ptr, sc_sn, ape_ptr, st_ptr, st_s,
                             st_r, RING, c_buf, c_su, c_P, c_sr, RATIO, W, OVERLAP, CD, HAS_APE, D, TILE, NT, TPI,
                             DATA, SCALE, Q_EXP, Q_MANT, HW)
            else:
                if HAS_IDX:
                    _index_item(idx_ptr, ld, i - kv_items, DONE_ROW, IE_ROW, ikv_ptr, ikv_sn, isc_ptr, isc_sn,
                                iape_ptr, ist_ptr, ist_s, ist_r, IRING, x_buf, x_su, x_P, x_sr, RATIO, W, OVERLAP,
                                HAS_IAPE, ID, IDATA, ISCALE, Q_EXP, Q_MANT, HW)
            i += n_pool
    elif pid < n_pool + end_tok:
        t = ((pid - n_pool) * BT + tl.arange(0, BT)).to(tl.int64)
        ok = t < n
        if do_swa != 0:
            slot = tl.load(idx_ptr + SWA * ld + t, mask=ok, other=0)
            ds_mla_store_rows(sw_val + t * sw_vsn, ok, sw_buf + (slot // sw_P) * sw_su, slot % sw_P, sw_sr,
                              NT * TILE, ROPE_W, TILE, NT + 1, DATA, SCALE, Q_EXP, Q_MANT, HW)
        if do_app != 0:
            if HAS_CMP:
                _append(idx_ptr, ld, t, ok, kv_ptr, kv_sn, sc_ptr, sc_sn, ape_ptr, st_ptr, st_s, st_r, RING,
                        CD, RATIO, HAS_APE)
            if HAS_IDX:
                _append(idx_ptr, ld, t, ok, ikv_ptr, ikv_sn, isc_ptr, isc_sn, iape_ptr, ist_ptr, ist_s, ist_r,
                        IRING, 2 * ID, RATIO, HAS_IAPE)


def _ring_args(step, ring, kv, score):
    """Pointer and stride arguments of one ring (kv, score, ape, state layer, pool layer)."""
    st = ring.state[:, ring.layer]
    kv, score = kv.contiguous(), score.contiguous()
    ape = ring.ape.float().contiguous() if ring.ape is not None else kv
    p = ring.pool
    return (kv, kv.stride(0), score, score.stride(0), ape, st, st.stride(0), st.stride(1), st.shape[1],
            p.buffer[:, p.layer], p.buffer.stride(0), p.geom.entries, p.geom.scale_region,
            step.entry_row(ring.ratio))


def _dummy_ring(like):
    return (like, 0, like, 0, like, like, 0, 0, 1, like, 0, 1, 0, 0)


def write_layer(step, targets, swa_kv, rings) -> None:
    """Launch the fused write of one layer (`rings`: (name, RingTarget, kv, score) from write.py)."""
    if not rings:   # an SWA-only layer is one store: the kernel tuned for it
        s = targets.swa
        return codec_triton.store(s.codec, s.geom, s.buffer, range(s.layer, s.layer + 1), step.row(_rows.SWA),
                                  swa_kv[None])
    head, args, const, tok, pool, one = launch_plan(step, targets, swa_kv, rings)
    phases = [(tok, pool, 1, 1)] if one else [(tok, pool, 1, 0), (tok, 0, 0, 1)]
    for end_tok, n_pool, do_swa, do_app in phases:   # pool before append: a long run overwrites rows it reads
        launch(head, args, const, end_tok, n_pool, do_swa, do_app)


def launch(head, args, const, end_tok, n_pool, do_swa, do_app):
    warps = CONFIG["num_warps" if const["W"] <= 16 else "c128_warps"]
    _write_layer[(end_tok + n_pool,)](*head, *args, end_tok, n_pool, do_swa, do_app, **const, num_warps=warps,
                                      enable_fp_fusion=False)


def launch_plan(step, targets, swa_kv, rings):
    """Arguments of `_write_layer` for one layer with rings: (head, args, const, token programs,
    pool programs, whether one launch suffices)."""
    by_name = {name: r for name, *r in rings}
    kv_ring, ix_ring = by_name.get(""), by_name.get("index_")
    s, n = targets.swa, step.num_tokens
    vals = swa_kv.to(torch.bfloat16).contiguous()
    spec = (kv_ring or ix_ring)[0].spec
    one = all(step.max_run_tokens <= r.state.shape[2] - r.spec.window + 1 for _, r, _, _ in rings)
    short = spec.window <= 16
    bt = CONFIG["swa_bt" if short else "c128_chunk_bt" if n >= CHUNK_TOKENS else "c128_bt"]
    tpi = CONFIG["c4_tpi" if short else "c128_tpi"]
    const = dict(HAS_CMP=kv_ring is not None, RATIO=spec.ratio, W=spec.window, OVERLAP=bool(spec.overlap),
                 CD=spec.coff * 512, HAS_APE=bool(kv_ring and kv_ring[0].ape is not None), HAS_IDX=ix_ring is not None,
                 HAS_IAPE=bool(ix_ring and ix_ring[0].ape is not None), D=512, TILE=DS_MLA_TILE,
                 NT=NOPE // DS_MLA_TILE, DATA=s.geom.fmt.data_bytes, SCALE=s.geom.fmt.scale_bytes,
                 ID=INDEX_WIDTH, IDATA=ix_ring[0].pool.geom.fmt.data_bytes if ix_ring else 128,
                 ISCALE=ix_ring[0].pool.geom.fmt.scale_bytes if ix_ring else 4, ROPE_W=ROPE,
                 Q_EXP=_E4M3_EXP, Q_MANT=_Q_MANT, BT=bt, HW=HW_CAST, TPI=tpi)
    cnt = step.table[step.count_row, step.count_at(spec.ratio):]
    head = (step.table, step.table.stride(0), n, cnt, vals, vals.stride(0), s.buffer[:, s.layer],
            s.buffer.stride(0), s.geom.entries, s.geom.scale_region)
    args = (*(_ring_args(step, *kv_ring) if kv_ring else _dummy_ring(vals)),
            *(_ring_args(step, *ix_ring) if ix_ring else _dummy_ring(vals)),
            step.done_row(spec.ratio))
    # pool programs: one per work item of a step whose runs complete one block per `ratio` tokens
    # (a decode step, about; a chunk); more blocks are taken in turns. The count depends on n only.
    items = (NOPE // DS_MLA_TILE + 1) // tpi + 1     # per completed block, KV + indexer
    pool = min(CONFIG["pool_programs" if short else "c128_pool_programs"], triton.cdiv(n, spec.ratio) * items)
    return head, args, const, triton.cdiv(n, bt), pool, one
