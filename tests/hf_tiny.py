"""A tiny random transformers DeepSeek-V4 that keeps the real per-layer structure: sliding-window
only, CSA (ratio 4, overlapped windows, lightning indexer) and HCA (ratio 128) layers, window 128,
the real row widths (512 KV, 64 rope, 128 indexer); everything else small, for the CPU.

`_init_weights` leaves the compressors' position bias, the attention sinks, the hash router's
table and the router bias at 0; they are drawn here, or several code paths would be trivial (a
zero bias hides the overlap's bias, a zero table routes every token alike). The pad token is None:
a pad id inside a prompt would be masked by generate. A bf16 model keeps in float32 what the
released checkpoints keep in float32 (`_keep_in_fp32_modules_strict`: the position bias among
them, so the overlap gate is float32). The indexer has 16 heads: its scores are sums over heads of
ReLUs, and with 2 heads many are exactly 0, so its top-k picks among ties by their place in the
candidate array, and the model's own one-shot and chunked runs disagree (16 make ties rare)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402

from kvatlas.integrations.transformers import as_checkpoint_loads  # noqa: E402
from kvatlas.integrations.transformers.model import cache_keyword  # noqa: E402

VOCAB = 256
LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
          "compressed_sparse_attention"]


def config(**over) -> "DeepseekV4Config":
    kw = dict(vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=len(LAYERS),
              layer_types=list(LAYERS), num_attention_heads=2, head_dim=512, q_lora_rank=32,
              num_experts_per_tok=2, n_routed_experts=4, o_groups=2, o_lora_rank=16, index_n_heads=16,
              index_head_dim=128, index_topk=8, sliding_window=128, max_position_embeddings=4096,
              pad_token_id=None, eos_token_id=None, bos_token_id=None, hc_sinkhorn_iters=4,
              num_nextn_predict_layers=0)
    kw.update(over)
    return DeepseekV4Config(**kw)


def model(dtype=torch.float32, seed: int = 0, device="cpu", **over):
    """The tiny model in `dtype` on `device`, every parameter drawn (the ones _init_weights zeroes too)."""
    torch.manual_seed(seed)
    if dtype == torch.float64:   # the grouped-matmul experts take no float64
        over.setdefault("experts_implementation", "eager")
    m = DeepseekV4ForCausalLM(config(**over))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("position_bias", "sinks")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for name, b in m.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, m.config.n_routed_experts, b.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return as_checkpoint_loads(m, dtype).eval().to(device)


def cache_kw(m, cache) -> dict:
    """The cache as the keyword the model's forward and generate take (`cache` from transformers
    5.24 on, where `past_key_values` warns; `past_key_values` before)."""
    return {cache_keyword(m): cache}


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.as_tensor(np.random.default_rng(seed).integers(0, VOCAB, n), dtype=torch.long)[None]
