"""write_layer: everything one layer writes in one step, as an engine issues it (layer by layer).

    step = StepIndices.of(cache.step(batch), device)      # once per step (or step.load(w) to refill)
    for layer in layers:                                   # inside the forward pass
        write_layer(step, targets[layer], swa_kv=..., kv=..., score=..., index_kv=..., index_score=...)

One layer's write is: the SWA entry of every token (quantized into its page), the append of every
token's kv/score row to the compressor ring, and every compressed entry the step completes
(pooled from its window, rounded to bf16, quantized straight into its page) — for the attention
KV and, on C4 layers, the indexer keys. Compressed entries are stored as pooled: a model applies
RMSNorm, RoPE and the indexer's rotation between pooling and storing, which are its weights'
business, so an engine with those steps fuses them or stores through `paged.store`.

Two paths, the same bytes:
- impl="torch": the reference, composed of `paged.store` and `compressor.compress_batch`; it
  syncs with the host (the number of completed blocks is data-dependent). Any format, any device.
- impl="triton" (auto on CUDA for fp8_ds_mla KV, fp8 indexer, fp32/bf16 rings): one kernel launch,
  no host synchronization — every token's program decides on the device whether it completes a
  block — so a CUDA graph can capture it. A run of tokens longer than ring − window + 1 (a prefill
  chunk) would overwrite ring rows its own blocks still read, so then the ring append goes in a
  second launch after pooling. The step's inputs must stay where they are while a graph replays.
"""

from __future__ import annotations

import torch

from . import kernels
from .compressor import compress_batch
from .errors import DataPathError
from .paged import store
from .step import POS, REQ, SWA, LayerTargets, RingTarget, StepIndices

_TRITON_FORMATS = {"swa": "fp8_ds_mla", "kv": "fp8_ds_mla", "index": "indexer_fp8"}


def _check_input(name, x, n: int, width: int) -> None:
    if x is None:
        raise DataPathError(name, "missing", f"pass {name} [{n}, {width}] for this layer's pool")
    if tuple(x.shape) != (n, width) or not x.is_floating_point():
        raise DataPathError(name, f"{x.dtype} {tuple(x.shape)}", f"pass floating {name} of shape [{n}, {width}]")


def _check(step: StepIndices, t: LayerTargets, swa_kv, rings) -> None:
    n = step.num_tokens
    if not step.loaded:
        raise DataPathError("step", "no indices loaded", "call step.load(write_indices) first")
    if t.swa is not None:
        _check_input("swa_kv", swa_kv, n, t.swa.codec.width)
    for name, ring, kv, score in rings:
        cd = ring.spec.coff * ring.spec.head_dim
        _check_input(f"{name}kv", kv, n, cd)
        _check_input(f"{name}score", score, n, cd)
        step.entry_row(ring.ratio)   # raises if the step lacks this ratio's entries
    held = [t.swa.buffer] if t.swa is not None else []
    for dev in {x.device for x in held + [r.state for _, r, _, _ in rings]}:
        if dev != step.device:
            raise DataPathError("step", f"indices on {step.device}, pools on {dev}",
                                "prepare StepIndices on the cache's device")


def _rings(t: LayerTargets, kv, score, index_kv, index_score):
    out = []
    if t.kv is not None:
        out.append(("", t.kv, kv, score))
    if t.index is not None:
        out.append(("index_", t.index, index_kv, index_score))
    return out


def _triton_ok(t: LayerTargets, rings) -> bool:
    if not kernels.available() or t.swa is None or not t.swa.buffer.is_cuda:
        return False
    pools = {"swa": t.swa, **{("kv" if r is t.kv else "index"): r.pool for _, r, _, _ in rings}}
    if any(p.codec.fmt.name != _TRITON_FORMATS[k] for k, p in pools.items()):
        return False
    return all(r.state.dtype in (torch.float32, torch.bfloat16) for _, r, _, _ in rings)


def write_layer(step: StepIndices, targets: LayerTargets, *, swa_kv=None, kv=None, score=None,
                index_kv=None, index_score=None, validate: bool = True, impl: str = "auto") -> None:
    """Write one layer's step: SWA entries, ring appends, completed compressed entries (+ indexer).

    swa_kv: bf16 [n, 512]; kv/score: [n, coff·512] (the attention compressor's projections);
    index_kv/index_score: [n, 2·128] on C4 layers. n = step.num_tokens, tokens in step order."""
    if impl not in ("auto", "torch", "triton"):
        raise DataPathError("impl", f"{impl!r}", "use auto, torch or triton")
    rings = _rings(targets, kv, score, index_kv, index_score)
    if validate:
        _check(step, targets, swa_kv, rings)
    fast = _triton_ok(targets, rings)
    if impl == "triton" and not fast:
        raise DataPathError("impl", "no fused Triton write for these formats/devices",
                            "use impl='auto' (fp8_ds_mla KV, fp8 indexer, fp32/bf16 rings on CUDA have one)")
    if fast and impl != "torch":
        from .kernels import write_triton
        return write_triton.write_layer(step, targets, swa_kv, rings)
    _write_torch(step, targets, swa_kv, rings)


def _write_torch(step: StepIndices, t: LayerTargets, swa_kv, rings) -> None:
    """The reference: today's store and compress_batch, in the order the kernel keeps."""
    if t.swa is not None:
        s = t.swa
        store(s.geom, s.buffer, s.layer, step.row(SWA), swa_kv, parallel=s.parallel, codec=s.codec,
              validate=False, impl="torch")
    req, pos = step.row(REQ), step.row(POS)
    for _, ring, kv, score in rings:
        _compress_into_pool(step, ring, req, pos, kv, score)


def _compress_into_pool(step, ring: RingTarget, req, pos, kv, score) -> None:
    blocks = compress_batch(ring.state, ring.layer, req, pos, kv, score, ratio=ring.ratio, ape=ring.ape,
                            validate=False, impl="torch")
    done = (pos + 1) % ring.ratio == 0          # blocks come in token order, as this mask does
    slots = step.row(step.entry_row(ring.ratio))[done]
    p = ring.pool
    store(p.geom, p.buffer, p.layer, slots, blocks.entries, parallel=p.parallel, codec=p.codec,
          validate=False, impl="torch")

