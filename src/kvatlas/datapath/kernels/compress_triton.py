"""Triton ring compression and ring append, the contract of `compressor._compress_torch` /
`_append_torch`. One compress program pools one block over BLOCK_D channels; one append program
writes one token's row (the part of it this program covers). Rows are rounded through the state
dtype exactly like the reference, so only exp/sum ordering differs (fp32 tolerance). Verified
against the reference under TRITON_INTERPRET=1 (tests/test_datapath_triton_interpret.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def bf16_round(x):
    """fp32 -> the nearest bf16 value (as fp32), round half to even with integer ops (matches
    torch's cast on every backend, the CPU interpreter included); ±inf stay inf."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _to_state(x, st_ptr):
    """Round fp32 to the state dtype and back."""
    if st_ptr.dtype.element_ty == tl.bfloat16:
        x = bf16_round(x)
    return x


@triton.jit
def _compress(out_ptr, kv_ptr, sc_ptr, kv_sn, sc_sn, ape_ptr, st_ptr, st_s, st_l, st_r,
              req_ptr, first_ptr, tok_end_ptr, pos_ptr, layer, RING,
              D: tl.constexpr, CD: tl.constexpr, RATIO: tl.constexpr, W: tl.constexpr, OVERLAP: tl.constexpr,
              HAS_APE: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    tok = tl.load(tok_end_ptr + b)
    p_end = tl.load(pos_ptr + tok)
    first = tl.load(first_ptr + tok)
    req = tl.load(req_ptr + tok).to(tl.int64)
    w = tl.arange(0, W)
    q = p_end - (W - 1) + w                              # window positions
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    if OVERLAP:   # previous block's rows read [:D], current block's rows [D:] (overlap_transform)
        half = tl.where(w < RATIO, 0, D)
    else:
        half = w * 0
    ch = half[:, None] + cols[None, :]
    in_b = q >= first
    from_ring = (q < first) & (q >= 0)
    qc = tl.where(q >= 0, q, 0)
    idx = tl.where(in_b, tok - (p_end - q), 0)
    m_in = in_b[:, None] & (cols < D)[None, :]
    kv_in = tl.load(kv_ptr + idx[:, None] * kv_sn + ch, mask=m_in, other=0.0).to(tl.float32)
    sc_in = tl.load(sc_ptr + idx[:, None] * sc_sn + ch, mask=m_in, other=0.0).to(tl.float32)
    if HAS_APE:
        sc_in += tl.load(ape_ptr + (qc % RATIO)[:, None] * CD + ch, mask=m_in, other=0.0)
    kv_in = _to_state(kv_in, st_ptr)                     # batch rows pass through the state dtype
    sc_in = _to_state(sc_in, st_ptr)
    srow = st_ptr + req * st_s + layer * st_l + (qc % RING)[:, None] * st_r
    m_st = from_ring[:, None] & (cols < D)[None, :]
    kv_st = tl.load(srow + ch, mask=m_st, other=0.0).to(tl.float32)
    sc_st = tl.load(srow + CD + ch, mask=m_st, other=0.0).to(tl.float32)
    neg_inf = tl.zeros([W, BLOCK_D], dtype=tl.float32) - float("inf")
    kv = tl.where(in_b[:, None], kv_in, kv_st)           # rows before position 0: kv 0 ...
    sc = tl.where(in_b[:, None], sc_in, tl.where(from_ring[:, None], sc_st, neg_inf))  # ... score -inf
    mx = tl.max(sc, axis=0)
    e = tl.exp(sc - mx[None, :])
    out = tl.sum(e * kv, axis=0) / tl.sum(e, axis=0)
    tl.store(out_ptr + b * D + cols, out, mask=cols < D)


@triton.jit
def _append(kv_ptr, sc_ptr, kv_sn, sc_sn, ape_ptr, st_ptr, st_s, st_l, st_r,
            req_ptr, pos_ptr, last_ptr, layer, RING,
            CD: tl.constexpr, RATIO: tl.constexpr, HAS_APE: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t)
    last = tl.load(last_ptr + t)
    if p > last - RING:   # older rows of a long run would be overwritten within this batch
        req = tl.load(req_ptr + t).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < CD
        kv = tl.load(kv_ptr + t * kv_sn + cols, mask=m, other=0.0).to(tl.float32)
        sc = tl.load(sc_ptr + t * sc_sn + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_APE:
            sc += tl.load(ape_ptr + (p % RATIO) * CD + cols, mask=m, other=0.0)
        row = st_ptr + req * st_s + layer * st_l + (p % RING) * st_r
        tl.store(row + cols, _to_state(kv, st_ptr).to(st_ptr.dtype.element_ty), mask=m)
        tl.store(row + CD + cols, _to_state(sc, st_ptr).to(st_ptr.dtype.element_ty), mask=m)


def _inputs(kv, score, ape):
    kv, score = kv.contiguous(), score.contiguous()
    ape_t = ape.float().contiguous() if ape is not None else kv
    return kv, score, ape_t


def compress(spec, state, layer, req_slots, positions, plan, kv, score, ape):
    m = plan.tok_end.numel()
    out = torch.empty((m, spec.head_dim), dtype=torch.float32, device=state.device)
    if m == 0:
        return out
    kv, score, ape_t = _inputs(kv, score, ape)
    block_d = 128 if spec.window <= 16 else 32
    block_d = min(block_d, spec.head_dim)
    grid = (m, triton.cdiv(spec.head_dim, block_d))
    _compress[grid](out, kv, score, kv.stride(0), score.stride(0), ape_t,
                    state, state.stride(0), state.stride(1), state.stride(2),
                    req_slots.contiguous(), plan.first.contiguous(), plan.tok_end.contiguous(),
                    positions.contiguous(), layer, state.shape[2],
                    D=spec.head_dim, CD=spec.coff * spec.head_dim, RATIO=spec.ratio, W=spec.window,
                    OVERLAP=spec.overlap, HAS_APE=ape is not None, BLOCK_D=block_d,
                    num_warps=4 if spec.window <= 16 else 8)
    return out


def append(spec, state, layer, req_slots, positions, plan, kv, score, ape) -> None:
    n = positions.numel()
    if n == 0:
        return
    kv, score, ape_t = _inputs(kv, score, ape)
    cd = spec.coff * spec.head_dim
    block = min(256, triton.next_power_of_2(cd))
    _append[(n, triton.cdiv(cd, block))](
        kv, score, kv.stride(0), score.stride(0), ape_t,
        state, state.stride(0), state.stride(1), state.stride(2),
        req_slots.contiguous(), positions.contiguous(), plan.last.contiguous(), layer, state.shape[2],
        CD=cd, RATIO=spec.ratio, HAS_APE=ape is not None, BLOCK=block, num_warps=4)
