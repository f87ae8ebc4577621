"""Bytes one DeepSeek-V4-Flash request holds: kvatlas (fp8 and bf16 layouts) against the model's own
cache in transformers (bf16, as a released checkpoint computes), at 4K / 32K / 128K context.

The model's own cache: its layer classes (DynamicSlidingWindowLayer, DeepseekV4CSACache,
DeepseekV4HCACache) driven with what the model hands them, in 8,192-token chunks: per layer the
keys of each chunk (`update`), the compressor and indexer projections (`store_compression_weights`),
the last window's overlap (`update_overlap_state`, its gate float32 as in a bf16 checkpoint) and
the windows' entries (`update_compressor_states`); every storage then counted once by
kvatlas.audit. The same drive at a short context is checked, layer by layer, against the cache a
real forward pass of a small model with V4-Flash's row widths leaves (`--check`).

kvatlas: layout "fp8" (fp8_ds_mla KV, fp8 indexer keys, fp32 rings) and "exact" for a bf16
checkpoint (bf16 KV and indexer keys, bf16 rings: the raw projections), a V4-Flash plan (the same 43 layers: 2 sliding-window, 21 CSA, 20 HCA; no MTP layer, as
transformers builds none), one request extended to the context (bookkeeping only, no tensors):
the bytes it holds, every pool (pages and request slot: SWA pages, rings, block table).

    python bench/transformers_bytes.py [--contexts 4096,32768,131072] [--check]
"""

from __future__ import annotations

import argparse

import torch

import kvatlas
from kvatlas.cache.audit import audit

CHUNK = 8192
FLASH = ["sliding_attention"] * 2 + ["compressed_sparse_attention", "heavily_compressed_attention"] * 20 + \
        ["compressed_sparse_attention"]


def own_layer(kind: str, config, tokens: int, dtype=torch.bfloat16):
    """One layer of the model's own cache after `tokens` tokens as the model drives it: a prefill in
    chunks, then one decode token. (Right after a prefill chunk the cache holds more: its window and
    buffers are views into that chunk's whole tensors, kept alive until the next pass.)"""
    from transformers.cache_utils import DynamicSlidingWindowLayer
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACache, DeepseekV4HCACache
    d, di = config.head_dim, config.index_head_dim
    if kind == "sliding_attention":
        layer = DynamicSlidingWindowLayer(sliding_window=config.sliding_window)
    else:
        layer = (DeepseekV4CSACache if kind == "compressed_sparse_attention" else DeepseekV4HCACache)(config)
    names = {"sliding_attention": {}, "heavily_compressed_attention": {"compressor": d},
             "compressed_sparse_attention": {"compressor": d, "indexer": di}}[kind]
    done = 0
    while done < tokens:   # prefill chunks, then one decode token: what a decoding request holds
        n = min(CHUNK, tokens - 1 - done) if done < tokens - 1 else 1
        kv = torch.randn(1, 1, n, d).to(dtype)
        layer.update(kv, kv)
        for name, width in names.items():
            coff = 2 if kind == "compressed_sparse_attention" else 1
            chunk_kv, chunk_gate, _ = layer.store_compression_weights(
                name, torch.randn(1, n, coff * width).to(dtype), torch.randn(1, n, coff * width).to(dtype))
            windows = chunk_kv.shape[1] // layer.compress_rate
            if windows and coff == 2:
                shape = (1, windows, layer.compress_rate, coff * width)
                layer.update_overlap_state(name, chunk_kv.view(shape), chunk_gate.view(shape).float(), width)
            layer.update_compressor_states(name, torch.randn(1, windows, width).to(dtype))
        done += n
    return layer


def own_bytes(config, tokens: int, kinds=FLASH) -> int:
    per_kind = {k: audit(own_layer(k, config, tokens)).total_bytes for k in set(kinds)}
    return sum(per_kind[k] for k in kinds)


def kvatlas_bytes(tokens: int, layout: str, indexer: str, state: str) -> tuple[int, float]:
    """(bytes one request of `tokens` holds, the plan's bytes per token)."""
    p = kvatlas.plan("deepseek-v4-flash", "64GiB", max_running_requests=1, max_model_len=max(tokens, 8192),
                     kv_layout=layout, indexer=indexer, state_dtype=state, chunked_prefill_tokens=8192)
    c = kvatlas.allocate(p, backend="none")
    c.admit("r", tokens, 0)
    done = 0
    while done < tokens - 1:   # as the model's own cache above: a chunked prefill, one decode token
        n = min(8192, tokens - 1 - done)
        c.extend("r", n)
        done += n
    c.step(["r"])
    c.flush()
    held = sum(u["held_bytes"] for u in c.request_usage("r").values())
    return held, p.bytes_per_token


def check(dtype=torch.bfloat16) -> None:
    """The drive above leaves what a real forward pass leaves, layer by layer."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import hf_tiny
    from transformers import DynamicCache
    m = hf_tiny.model(dtype)
    for tokens in (300, 700):
        cache, ids = DynamicCache(config=m.config), hf_tiny.prompt(tokens)
        with torch.no_grad():
            m(ids[:, :-1], past_key_values=cache, use_cache=True)
            m(ids[:, -1:], past_key_values=cache, use_cache=True)
        for i, kind in enumerate(m.config.layer_types):
            real, driven = audit(cache.layers[i]).total_bytes, audit(own_layer(kind, m.config, tokens)).total_bytes
            assert real == driven, (tokens, kind, real, driven)
            print(f"check {tokens:>4} tokens, {kind:<28} real forward {real:>10,} B == driven {driven:>10,} B")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--check", action="store_true", help="first compare the drive with a real forward pass")
    args = ap.parse_args()
    if args.check:
        check()
    from transformers import DeepseekV4Config
    config = DeepseekV4Config(layer_types=FLASH, num_hidden_layers=len(FLASH))   # V4-Flash's shapes
    contexts = [int(x) for x in args.contexts.split(",")]
    rows = []
    for n in contexts:
        own = own_bytes(config, n)
        fp8, fp8_slope = kvatlas_bytes(n, "v4", "fp8", "fp32")          # layout="fp8": what engines store
        bf16, bf16_slope = kvatlas_bytes(n, "bf16", "bf16", "bf16")     # layout="exact" for a bf16 checkpoint
        rows.append((n, own, fp8, bf16, fp8_slope, bf16_slope))
    print("\n| context | own cache (bf16) | kvatlas fp8 | ratio | kvatlas bf16 (exact) | ratio |")
    print("|---|---|---|---|---|---|")
    for n, own, fp8, bf16, _, _ in rows:
        print(f"| {n:,} | {own:,} B ({own / n:,.1f} B/token) | {fp8:,} B ({fp8 / n:,.1f}) | {fp8 / own:.3f} | "
              f"{bf16:,} B ({bf16 / n:,.1f}) | {bf16 / own:.3f} |")
    (n0, o0, *_), (n1, o1, *_) = rows[0], rows[-1]
    own_slope = (o1 - o0) / (n1 - n0)
    fp8_slope, bf16_slope = rows[0][4], rows[0][5]
    print(f"\nper token (slope): own cache {own_slope:,.2f} B; kvatlas fp8 {fp8_slope:,.2f} B "
          f"({fp8_slope / own_slope:.3f}x); kvatlas bf16 {bf16_slope:,.2f} B ({bf16_slope / own_slope:.3f}x)")
    own_fixed = o0 - own_slope * n0
    print(f"per request (intercept): own cache {own_fixed:,.0f} B; kvatlas fp8 {rows[0][2] - fp8_slope * n0:,.0f} B "
          f"(page-rounded at {n0:,}); kvatlas bf16 {rows[0][3] - bf16_slope * n0:,.0f} B")


if __name__ == "__main__":
    main()
