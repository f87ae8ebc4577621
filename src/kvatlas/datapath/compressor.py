"""Compressor state rings: append each token's kv/score row, pool completed blocks.

Semantics follow the official DeepSeek-V4 `inference/model.py` (`Compressor.forward`,
`overlap_transform`), cross-checked against SGLang's `c4_v2.cuh` / `c128_v2.cuh` and vLLM's fused
compressor (see the notes cited in the docs):
- A token at position p contributes kv_p and score_p (each coff·D wide; coff = 2 for C4). The
  learned positional bias `ape[p % r]` is added to the score *before* the row is stored — the
  official/vLLM convention ("score_state = score + ape"); SGLang instead stores the raw score. A
  state written under one convention cannot be read under the other.
- Block i (positions r·i .. r·i+r-1) completes at p = r·i + r - 1. C128 pools its 128 rows. C4 pools
  8 rows, tokens 4i-4 .. 4i+3: the previous block's 4 tokens contribute their first half [:D] of kv
  and score, the current block's 4 tokens their second half [D:] (official `overlap_transform`:
  new[..., r:] = cur[..., D:], new[:, 1:, :r] = prev[..., :D]). Positions below 0 read as cleared
  rows (kv 0, score -inf), so block 0 pools only its own 4 tokens.
- Pooling: per channel, softmax over the window's rows of the score, weighting the kv (fp32).
The caller applies what follows pooling — RMSNorm, RoPE at position r·i, the indexer's Hadamard
rotation — then stores the entry with `paged.store` at `geometry.compressed_slots(...)`.

Ring layout (SPEC §4, SGLang's CompressStatePool): state [slots, n_layers, ring, 2·coff·D]; row of
position p of request slot s is state[s, layer, p % ring] = [kv (coff·D) | score+ape (coff·D)].
Every row passes through the state dtype, also rows pooled straight from the batch, so the result
does not depend on how the sequence was split into calls.

Batches: tokens of one request form one contiguous run of consecutive positions (a prefill chunk,
a decode token, a verify batch of drafts); many requests may share a call. Rows of a window that
are in the batch come from the inputs; older rows come from the ring, which must still hold them:
ring >= window always, and drafts beyond the write pad are caught by `rollback`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from .errors import DataPathError, RingOverrunError, SlotError


@dataclass(frozen=True, slots=True)
class CompressorSpec:
    ratio: int      # 4 (overlapped C4) or any r > 0 without overlap (C128)
    head_dim: int   # D: 512 for the attention KV, 128 for the indexer

    @property
    def overlap(self) -> bool:
        return self.ratio == 4

    @property
    def coff(self) -> int:
        return 2 if self.overlap else 1

    @property
    def window(self) -> int:
        return self.coff * self.ratio

    @property
    def width(self) -> int:
        """State row width: kv then score, coff·D each."""
        return 2 * self.coff * self.head_dim

    @classmethod
    def for_state(cls, state: torch.Tensor, ratio: int) -> "CompressorSpec":
        coff = 2 if ratio == 4 else 1
        spec = cls(ratio, state.shape[-1] // (2 * coff))
        if state.dim() != 4 or spec.width != state.shape[-1] or state.shape[2] < spec.window:
            raise DataPathError("state", f"shape {tuple(state.shape)} for ratio {ratio}",
                                f"pass [slots, layers, ring >= {spec.window}, 2·{coff}·D]")
        return spec


@dataclass(frozen=True, slots=True)
class Blocks:
    """Compressed entries formed by one call: block `block_ids[k]` of request `req_slots[k]`."""
    req_slots: torch.Tensor
    block_ids: torch.Tensor
    entries: torch.Tensor   # fp32 [m, D], before norm / RoPE


@dataclass(frozen=True, slots=True)
class BatchPlan:
    first: torch.Tensor     # per token: first position of its request in this batch
    last: torch.Tensor      # per token: last position of its request in this batch
    tok_end: torch.Tensor   # per completed block: index of the token that completes it
    p_end: torch.Tensor     # per completed block: that token's position


def plan_batch(ratio: int, req_slots, positions, validate: bool = True) -> BatchPlan:
    """Runs of tokens per request and the blocks the batch completes (torch, on the batch's device)."""
    n = positions.numel()
    new_run = torch.ones(n, dtype=torch.bool, device=positions.device)
    new_run[1:] = req_slots[1:] != req_slots[:-1]
    run = torch.cumsum(new_run.long(), 0) - 1
    starts = torch.nonzero(new_run).flatten()
    ends = torch.cat((starts[1:] - 1, starts.new_tensor([n - 1])))
    if validate:
        _check_runs(req_slots, positions, new_run, starts)
    first, last = positions[starts][run], positions[ends][run]
    tok_end = torch.nonzero((positions + 1) % ratio == 0).flatten()
    return BatchPlan(first, last, tok_end, positions[tok_end])


def _check_runs(req_slots, positions, new_run, starts) -> None:
    if positions.numel() and int(positions.min()) < 0:
        raise SlotError("positions", "a negative position", "positions count from 0")
    steps = positions[1:] - positions[:-1]
    if bool(((steps != 1) & ~new_run[1:]).any()):
        raise DataPathError("positions", "a request's tokens are not consecutive",
                            "pass each request's tokens as one run of consecutive positions")
    if torch.unique(req_slots[starts]).numel() != starts.numel():
        raise DataPathError("req_slots", "a request appears in two runs", "group each request's tokens together")


def clear_rows(state: torch.Tensor, req_slots, layers=slice(None)) -> None:
    """Reset request slots' rings (kv 0, score -inf): a new request's rows before first use."""
    half = state.shape[-1] // 2
    state[req_slots, layers, :, :half] = 0
    state[req_slots, layers, :, half:] = float("-inf")


def _through(x: torch.Tensor, dtype) -> torch.Tensor:
    return x.to(dtype).float()


def state_rows(spec: CompressorSpec, kv, score, positions, ape, dtype) -> torch.Tensor:
    """The ring rows of tokens [n, width] in the state dtype: kv, then score + ape[p % r]."""
    sc = score.float()
    if ape is not None:
        sc = sc + ape.float()[positions.long() % spec.ratio]
    return torch.cat((kv.float(), sc), -1).to(dtype)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """[m, W, D] -> [m, D], summing rows w and w + W/2, then again on the halves: a fixed order of
    fp32 additions, which a kernel reproduces bit for bit (a reduction whose order is left to the
    library is not reproducible across devices). An odd row count carries its last row along."""
    while x.shape[1] > 1:
        h = x.shape[1] // 2
        x = torch.cat((x[:, :h] + x[:, h:2 * h], x[:, 2 * h:]), 1)
    return x[:, 0]


def pool(kv_rows: torch.Tensor, score_rows: torch.Tensor) -> torch.Tensor:
    """[m, W, D] window rows -> [m, D]: per channel softmax over rows weighting kv (fp32), as
    sum(e·kv) / sum(e) with e = exp(score - max): elementwise fp32 operations and additions in a
    fixed order, so any implementation with the same exp gives the same bits (the Triton write
    path uses libdevice's expf, which torch's CUDA exp is: byte for byte on an H200, tests)."""
    e = torch.exp(score_rows - score_rows.amax(dim=1, keepdim=True))
    return tree_sum(e * kv_rows) / tree_sum(e)


def _select_halves(spec: CompressorSpec, rows: torch.Tensor) -> torch.Tensor:
    """[m, W, coff·D] -> [m, W, D]: C4 previous-block rows take [:D], current-block rows [D:]."""
    if not spec.overlap:
        return rows
    d, r = spec.head_dim, spec.ratio
    return torch.cat((rows[:, :r, :d], rows[:, r:, d:]), dim=1)


def _compress_torch(spec, state, layer, req_slots, positions, plan, kv, score, ape):
    w = torch.arange(spec.window, device=positions.device)
    q = plan.p_end[:, None] - spec.window + 1 + w                      # [m, W] window positions
    in_batch = (q >= plan.first[plan.tok_end][:, None])[..., None]
    idx = (plan.tok_end[:, None] - (plan.p_end[:, None] - q)).clamp_min(0)
    fresh = state_rows(spec, kv[idx], score[idx], q.clamp_min(0), ape, state.dtype).float()
    ring = state[req_slots[plan.tok_end][:, None], layer, q.clamp_min(0) % state.shape[2]].float()
    rows = torch.where(in_batch, fresh, ring)
    cd = spec.coff * spec.head_dim
    cleared = (q < 0)[..., None]
    kv_rows = torch.where(cleared, 0.0, rows[..., :cd])
    sc_rows = torch.where(cleared, float("-inf"), rows[..., cd:])
    return pool(_select_halves(spec, kv_rows), _select_halves(spec, sc_rows))


def _append_torch(spec, state, layer, req_slots, positions, plan, kv, score, ape):
    keep = positions > plan.last - state.shape[2]   # older rows of a long run would be overwritten
    p = positions[keep]
    state[req_slots[keep], layer, p % state.shape[2]] = state_rows(spec, kv[keep], score[keep], p, ape, state.dtype)


def _check_inputs(spec, state, layer, req_slots, positions, kv, score, ape) -> None:
    cd = spec.coff * spec.head_dim
    n = positions.shape[0]
    if kv.shape != (n, cd) or score.shape != (n, cd) or req_slots.shape != (n,):
        raise DataPathError("kv", f"kv {tuple(kv.shape)}, score {tuple(score.shape)}, {n} positions",
                            f"pass kv and score of shape [n, {cd}] and n req_slots")
    if ape is not None and tuple(ape.shape) != (spec.ratio, cd):
        raise DataPathError("ape", f"shape {tuple(ape.shape)}", f"pass [{spec.ratio}, {cd}]")
    if not 0 <= layer < state.shape[1]:
        raise SlotError("layer", f"{layer} outside 0..{state.shape[1] - 1}", "pass a layer position of the state")
    if n and not 0 <= int(req_slots.min()) <= int(req_slots.max()) < state.shape[0]:
        raise SlotError("req_slots", "outside the state's slots", "pass allocated request slots")


def compress_batch(state, layer: int, req_slots, positions, kv, score, *, ratio: int, ape=None,
                   validate: bool = True, impl: str = "auto") -> Blocks:
    """Append a batch's rows to the rings of `layer` and pool every block the batch completes.

    Blocks completed by draft tokens are speculative: once `rollback` drops those tokens, the
    block is formed again from the accepted ones, so the caller overwrites its entry then.
    The number of completed blocks is data-dependent, so a call syncs with the device once
    (`torch.nonzero`); validate=True adds the checks' syncs.
    """
    spec = CompressorSpec.for_state(state, ratio)
    if validate:
        _check_inputs(spec, state, layer, req_slots, positions, kv, score, ape)
    plan = plan_batch(ratio, req_slots, positions, validate)
    gpu = impl != "torch" and state.is_cuda and kernels.available()
    if impl == "triton" and not gpu:
        raise DataPathError("impl", "Triton needs a CUDA state and triton installed", "use impl='auto'")
    args = (spec, state, layer, req_slots, positions, plan, kv, score, ape)
    # pool first: appending a long run may overwrite ring rows this batch's blocks still read
    entries = kernels.compress(*args) if gpu else _compress_torch(*args)
    (kernels.append if gpu else _append_torch)(*args)
    block_ids = plan.p_end // ratio
    return Blocks(req_slots[plan.tok_end], block_ids, entries)


def rollback(state, layers, req_slot: int, committed: int, written: int, *, ratio: int) -> None:
    """Drop draft rows of positions [committed, written): check that the drafts did not overwrite
    rows the next block still reads (the write pad of SPEC §4 bounds this), then clear them."""
    spec = CompressorSpec.for_state(state, ratio)
    ring = state.shape[2]
    if written <= committed:
        return
    next_start = max(committed // ratio * ratio - (ratio if spec.overlap else 0), 0)
    if written - 1 - ring >= next_start:
        raise RingOverrunError("written", f"drafts up to position {written - 1} overwrote rows from "
                               f"{next_start} that block {committed // ratio} needs (ring {ring})",
                               "write at most the ring's write pad of draft tokens per round")
    pos = torch.arange(max(committed, written - ring), written, device=state.device)
    clear_rows_at(state, layers, req_slot, pos % ring)


def clear_rows_at(state, layers, req_slot: int, ring_rows) -> None:
    half = state.shape[-1] // 2
    view = state[req_slot, layers]
    view[..., ring_rows, :half] = 0
    view[..., ring_rows, half:] = float("-inf")


def compress_sequence(kv, score, *, ratio: int, ape=None, state_dtype=torch.float32) -> torch.Tensor:
    """Oracle: every complete block of one whole sequence from position 0, at once ([T // r, D])."""
    coff = 2 if ratio == 4 else 1
    spec = CompressorSpec(ratio, kv.shape[-1] // coff)
    t = kv.shape[0] // ratio * ratio
    pos = torch.arange(t, device=kv.device)
    rows = state_rows(spec, kv[:t], score[:t], pos, ape, state_dtype).float()
    cd = coff * spec.head_dim
    blocks = rows.reshape(t // ratio, ratio, 2 * cd)
    if spec.overlap:  # prepend the previous block (cleared before block 0)
        prev = torch.cat((torch.zeros_like(blocks[:1]), blocks[:-1]))
        prev[:1, :, cd:] = float("-inf")
        blocks = torch.cat((prev, blocks), dim=1)
    return pool(_select_halves(spec, blocks[..., :cd]), _select_halves(spec, blocks[..., cd:]))
