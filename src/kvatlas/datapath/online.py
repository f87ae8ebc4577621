"""Online C128: one fp32 row per request instead of a 128-row ring.

Row layout [max (D) | sum (D) | kv (D)], as SGLang's `c128_online_v2.cuh`
(`flash_c128_online_decode_v2`): per channel, the running max of the biased scores, the running
sum of exp(score - max), and the running softmax-weighted *mean* of kv (kept normalised). A token
at in-block position 0 starts a fresh row without reading the old one (so it needs no clearing);
the token at position r-1 emits the pooled entry instead of writing the row back.

Where SGLang folds one token at a time, a batch here folds each run of a block's tokens into one
partial (max, sum, mean) and merges that with the row: the same softmax, up to fp32 rounding, so
`online == ring C128` holds within fp32 tolerance (tests). ape is added to the score, as in the
ring. Drafts cannot be rolled back (the row forgets what it folded in): speculative decoding needs
the ring (SGLang adds per-draft banks for that; not modelled here).
"""

from __future__ import annotations

import torch

from .compressor import Blocks, plan_batch
from .errors import DataPathError


def _segments(ratio, req_slots, positions):
    """Segment id per token: a new segment at every new request run or block boundary."""
    n = positions.numel()
    new = torch.ones(n, dtype=torch.bool, device=positions.device)
    new[1:] = (req_slots[1:] != req_slots[:-1]) | (positions[1:] % ratio == 0)
    seg = torch.cumsum(new.long(), 0) - 1
    starts = torch.nonzero(new).flatten()
    ends = torch.cat((starts[1:] - 1, starts.new_tensor([n - 1])))
    return seg, starts, ends


def _fold(seg, nseg: int, kv, s):
    """Per segment and channel: max, sum of exp(s - max), softmax-weighted mean of kv."""
    d = s.shape[1]
    idx = seg[:, None].expand(-1, d)
    m = torch.full((nseg, d), float("-inf"), device=s.device).scatter_reduce(0, idx, s, "amax")
    e = torch.exp(s - m[seg])
    total = torch.zeros((nseg, d), device=s.device).scatter_add(0, idx, e)
    mean = torch.zeros((nseg, d), device=s.device).scatter_add(0, idx, e * kv) / total
    return m, total, mean


def _merge(m1, s1, k1, m2, s2, k2):
    m = torch.maximum(m1, m2)
    a, b = s1 * torch.exp(m1 - m), s2 * torch.exp(m2 - m)
    return m, a + b, (k1 * a + k2 * b) / (a + b)


def online_compress_batch(state, layer: int, req_slots, positions, kv, score, *, ratio: int = 128,
                          ape=None, validate: bool = True) -> Blocks:
    """Fold a batch into the online rows of `layer` ([slots, layers, 1, 3·D] fp32); pool the
    blocks the batch completes. Same batch rules as `compressor.compress_batch`."""
    d = kv.shape[1]
    if state.dtype != torch.float32 or state.dim() != 4 or state.shape[2:] != (1, 3 * d):
        raise DataPathError("state", f"{state.dtype} {tuple(state.shape)}",
                            f"online state is fp32 [slots, layers, 1, {3 * d}]")
    plan_batch(ratio, req_slots, positions, validate)  # validates the runs
    s = score.float() + (ape.float()[positions.long() % ratio] if ape is not None else 0.0)
    seg, starts, ends = _segments(ratio, req_slots, positions)
    m, total, mean = _fold(seg, starts.numel(), kv.float(), s)
    cont = positions[starts] % ratio != 0        # the block began in an earlier call: merge the row
    row = state[req_slots[starts], layer, 0]
    rm, rs, rk = row[:, :d], row[:, d:2 * d], row[:, 2 * d:]
    mm, ms, mk = _merge(rm, rs, rk, m, total, mean)
    c = cont[:, None]
    m, total, mean = torch.where(c, mm, m), torch.where(c, ms, total), torch.where(c, mk, mean)
    done = positions[ends] % ratio == ratio - 1
    open_ = ~done
    state[req_slots[starts][open_], layer, 0] = torch.cat((m, total, mean), 1)[open_]
    return Blocks(req_slots[starts][done], positions[ends][done] // ratio, mean[done])
