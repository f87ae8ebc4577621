"""What kvatlas needs to know of transformers' DeepSeek-V4 (`DeepseekV4ForCausalLM`): its config
as a kvatlas ModelSpec, the layouts that hold its rows, and where its compressors keep the
position bias that the overlap of a C4 window carries.

Layouts (`layout=`):
- "fp8" (kvatlas's default): fp8_ds_mla KV, fp8 indexer keys, fp32 rings: what the engines store
  (the model then reads dequantized rows; its arithmetic is unchanged).
- "exact": the model's own rows, bit for bit: KV and indexer keys in the model's dtype (bf16 ->
  the bf16 layout and indexer; float32 -> fp32; float64 -> fp64) and rings in the dtype of its
  compressors' projections (bf16 in a bf16 checkpoint): the rings keep those raw projections,
  and the one float32 value of the overlap (its gate, with the float32 position bias added) is
  recomputed when it is read, not stored.
"""

from __future__ import annotations

import inspect

import torch

from ...errors import ConfigError
from ...planning.model import load_model

KV_WIDTH, ROPE_WIDTH, INDEX_WIDTH = 512, 64, 128   # the widths kvatlas's row formats are made for
LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
_EXACT = {torch.bfloat16: ("bf16", "bf16"), torch.float16: ("fp32", "fp32"), torch.float32: ("fp32", "fp32"),
          torch.float64: ("fp64", "fp64")}
_STATE = {torch.bfloat16: "bf16", torch.float16: "fp32", torch.float32: "fp32", torch.float64: "fp64"}
LAYOUTS = ("fp8", "exact")


def check_model(model, field: str = "model"):
    """`model` if it is a transformers DeepSeek-V4 model (a module with a DeepSeek-V4 config);
    else a ConfigError naming the argument, never an AttributeError from inside."""
    import torch
    if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
        raise ConfigError(field, f"{type(model).__name__} is not a transformers model",
                          "give a DeepseekV4ForCausalLM (transformers), e.g. from_pretrained(...)")
    model_spec(model.config)
    return model


def cache_keyword(model) -> str:
    """The keyword the model's forward takes its cache by: `cache` from transformers 5.24 on
    (where `past_key_values` still works but warns, and goes in 5.40), `past_key_values` in 5.23,
    which knows no other."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def model_spec(config):
    """The kvatlas ModelSpec of a DeepseekV4Config, refused (ConfigError naming the field) where
    kvatlas's row formats cannot hold the model's rows."""
    types = getattr(config, "layer_types", None)
    if not isinstance(types, (list, tuple)) or any(t not in LAYER_TYPES for t in types):
        raise ConfigError("config.layer_types", f"{types!r} is not a DeepSeek-V4 layer schedule",
                          f"give a DeepseekV4Config (layer types {', '.join(LAYER_TYPES)})")
    for field, want in (("head_dim", KV_WIDTH), ("qk_rope_head_dim", ROPE_WIDTH), ("index_head_dim", INDEX_WIDTH),
                        ("num_key_value_heads", 1)):
        got = getattr(config, field, None)
        if got != want:
            raise ConfigError(f"config.{field}", f"is {got!r}; kvatlas's DeepSeek-V4 rows hold {want}",
                              f"use a DeepSeek-V4 geometry ({field}={want})")
    return load_model(config)


def _dtype_of(model) -> torch.dtype:
    """The dtype of the model's hidden states, which its KV rows and compressed entries carry."""
    return model.get_input_embeddings().weight.dtype


def layout_options(model, layout: str) -> dict:
    """kvatlas plan options (kv_layout, indexer, state_dtype) for `layout`."""
    if layout == "fp8":
        return {"kv_layout": "v4", "indexer": "fp8", "state_dtype": "fp32"}
    if layout != "exact":
        raise ConfigError("layout", f"{layout!r} is not a layout of this integration", f"use one of {', '.join(LAYOUTS)}")
    dtype = _dtype_of(model)
    if dtype not in _EXACT:
        raise ConfigError("layout", f"the model computes in {dtype}, which no kvatlas layout holds exactly",
                          "use bf16, float16, float32 or float64 weights, or layout='fp8'")
    kv, index = _EXACT[dtype]
    proj = {m.kv_proj.weight.dtype for c in compressors(model).values() for m in c.values()}
    proj |= {m.gate_proj.weight.dtype for c in compressors(model).values() for m in c.values()}
    if not proj <= set(_STATE):
        raise ConfigError("layout", f"the compressors project in {sorted(map(str, proj))}, which no ring holds "
                          "exactly", "use bf16, float16, float32 or float64 weights, or layout='fp8'")
    states = {_STATE[d] for d in proj} or {"fp32"}
    state = next(s for s in ("fp64", "fp32", "bf16") if s in states)   # the widest holds them all
    return {"kv_layout": kv, "indexer": index, "state_dtype": state}


def base_model(model):
    """The DeepseekV4Model inside a DeepseekV4ForCausalLM (or the model itself)."""
    return getattr(model, "model", model)


def compressors(model) -> dict[int, dict[str, torch.nn.Module]]:
    """Per compressed layer, per compressor name ("compressor", "indexer"): the module whose
    `position_bias` a window's gate adds before pooling. The overlap the next window reads carries
    that bias too; the rings keep the raw gate, so the layer adds the bias again when it hands the
    overlap back (read at that moment: the model may have been moved or loaded since)."""
    out: dict[int, dict] = {}
    for i, layer in enumerate(base_model(model).layers):
        comp = getattr(layer.self_attn, "compressor", None)
        if comp is None:
            continue
        out[i] = {"compressor": comp}
        if getattr(comp, "indexer", None) is not None:
            out[i]["indexer"] = comp.indexer
    return out


def as_checkpoint_loads(model, dtype=torch.bfloat16):
    """`model` in `dtype`, but for what transformers keeps in float32 when it loads a released
    checkpoint in that dtype (`_keep_in_fp32_modules_strict`: the position bias, the sinks, the
    hyper-connections and norms). A model built from a config and cast whole computes its overlap
    gate in bf16 instead, which no checkpoint does."""
    model = model.to(dtype)
    if dtype not in (torch.bfloat16, torch.float16):
        return model
    keep = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    for name, mod in model.named_modules():
        if name.split(".")[-1] in keep:
            mod.float()
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if name.split(".")[-1] in keep and p.is_floating_point():
            p.data = p.data.float()
    return model

