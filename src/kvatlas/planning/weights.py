"""Weights per rank from the config: every stored tensor of a DeepSeek-V4 checkpoint, its shape
and stored dtype, split the way the serving engines split it over TP and PP.

What the checkpoint stores (the public V4-Flash / V4-Pro `config.json` and safetensors index):
- `quantization_config` says fp8 (e4m3) weights in 128 × 128 blocks, one ue8m0 scale byte per
  block: every attention projection (wq_a, wq_b, wkv, wo_a, wo_b), the indexer's wq_b, the shared
  expert and the MTP block's e_proj / h_proj;
- `expert_dtype: fp4` stores every routed expert as e2m1 packed two per byte, with one ue8m0 scale
  per 32 values along the input dimension (MXFP4);
- everything else stays in the checkpoint's `torch_dtype` (bf16: embeddings, head, norms, the
  compressors' projections, the router), except what needs fp32 (attention sinks, the
  hyper-connection mixers, the compressors' positional bias, the router's bias) and the hash
  layers' token → expert table (int64).

How engines split it (SGLang 0.5.23 and vLLM 0.33 for DeepSeek-V4; stated as assumptions):
- TP splits the query heads (wq_b, the grouped wo_a, the sinks) and wo_b's input; the single
  KV head, the low-rank query down-projection, the compressors, the indexer and the router are
  replicated; vocab-parallel embedding and head; every expert's intermediate dimension split by
  TP, or whole experts spread over the ranks with expert parallelism (the same bytes per rank
  when the counts divide); the shared expert split by TP.
- PP gives each stage its share of the main layers (the planner's split), the embedding to the
  first stage, the final norm, head and MTP block to the last.

The parameter count (`parameter_count`) counts what transformers' `DeepseekV4ForCausalLM`
holds as parameters: the main layers without the MTP block, without scales, without the two
router buffers (bias and tid2eid).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..units import cdiv

FP8_BLOCK = 128        # the config's weight_block_size, both dims
FP4_GROUP = 32         # values per ue8m0 scale of an MXFP4 expert
ITEMSIZE = {"bf16": 2, "fp32": 4, "int64": 8}
WEIGHTS_SCHEMA = "kvatlas.weights"


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightArch:
    """The config fields the weights need beyond the attention geometry."""

    vocab_size: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    num_hash_layers: int
    hc_mult: int
    fp8_block: tuple[int, int] | None   # None: no fp8 quantization (bf16 checkpoint)
    expert_dtype: str                   # "fp4", "fp8" or "bf16"
    tie_word_embeddings: bool


_ARCH_FIELDS = ("vocab_size", "q_lora_rank", "o_lora_rank", "o_groups", "moe_intermediate_size",
                "n_routed_experts", "num_experts_per_tok")


# the smallest value each field may take (a count of 0 experts, ranks or groups builds no model)
_ARCH_MIN = {"vocab_size": 1, "q_lora_rank": 1, "o_lora_rank": 1, "o_groups": 1, "moe_intermediate_size": 1,
             "n_routed_experts": 1, "num_experts_per_tok": 1, "n_shared_experts": 0, "num_hash_layers": 0, "hc_mult": 1}
_DTYPES = ("bfloat16", "bf16")   # the released checkpoints' torch_dtype: what the tensors below assume


def arch_from_config(cfg: dict, where: str, heads: int | None = None, layers: int | None = None) -> WeightArch | None:
    """The weight-relevant fields, or None when the config lacks them (weights then unknown).
    Each is checked like the KV fields (type, range, divisibility against `heads` and `layers`,
    the model's attention heads and main layers), naming the field."""
    if any(k not in cfg for k in _ARCH_FIELDS):
        return None
    vals = {}
    for k in _ARCH_FIELDS + ("n_shared_experts", "num_hash_layers", "hc_mult"):
        v = cfg.get(k, {"n_shared_experts": 1, "num_hash_layers": 0, "hc_mult": 4}.get(k))
        low = _ARCH_MIN[k]
        if not isinstance(v, int) or isinstance(v, bool) or v < low or v > 2**31:
            raise ConfigError(f"{where}.{k}", f"{v!r} is not {'a positive' if low else 'a non-negative'} integer",
                              f"fix the value in config.json (an integer from {low} to {2**31:,})")
        vals[k] = v
    if vals["num_experts_per_tok"] > vals["n_routed_experts"]:
        raise ConfigError(f"{where}.num_experts_per_tok", f"{vals['num_experts_per_tok']:,} is more than the "
                          f"{vals['n_routed_experts']:,} routed experts (n_routed_experts)", "fix config.json")
    if heads is not None and heads % vals["o_groups"]:
        raise ConfigError(f"{where}.o_groups", f"{vals['o_groups']:,} does not divide the {heads:,} attention heads "
                          "(num_attention_heads): each output group takes a whole share of them",
                          "fix config.json (a divisor of num_attention_heads)")
    if layers is not None and vals["num_hash_layers"] > layers:
        raise ConfigError(f"{where}.num_hash_layers", f"{vals['num_hash_layers']:,} is more than the {layers:,} "
                          "layers (num_hidden_layers)", "fix config.json")
    tie = cfg.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ConfigError(f"{where}.tie_word_embeddings", f"{tie!r} is not true or false", "fix config.json")
    for key in ("torch_dtype", "dtype"):
        dtype = cfg.get(key)
        if dtype is not None and dtype not in _DTYPES:
            raise ConfigError(f"{where}.{key}", f"{dtype!r} is not bfloat16, the dtype kvatlas derives the weights for",
                              "give the released config, or the weights' bytes per rank as --weights BYTES")
    q = cfg.get("quantization_config") or {}
    if not isinstance(q, dict):
        raise ConfigError(f"{where}.quantization_config", "is not an object", "fix config.json")
    block = None
    if q:
        if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"{where}.quantization_config", f"{q.get('quant_method')!r}/{q.get('fmt')!r} is not "
                              "the fp8 e4m3 block quantization of the DeepSeek-V4 checkpoints",
                              "give the released config, or --weights BYTES")
        size = q.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
        if not (isinstance(size, list) and len(size) == 2 and all(isinstance(s, int) and s > 0 for s in size)):
            raise ConfigError(f"{where}.quantization_config.weight_block_size", f"{size!r} is not two sizes",
                              "fix config.json")
        block = (size[0], size[1])
    expert = cfg.get("expert_dtype", q.get("expert_dtype", "fp8" if block else "bf16"))
    if expert not in ("fp4", "fp8", "bf16"):
        raise ConfigError(f"{where}.expert_dtype", f"{expert!r} is not fp4, fp8 or bf16", "fix config.json")
    return WeightArch(**vals, fp8_block=block, expert_dtype=expert, tie_word_embeddings=tie)


@dataclass(frozen=True, slots=True, kw_only=True)
class Tensor:
    """One kind of stored tensor (the same on `count` layers or experts)."""

    name: str
    shape: tuple[int, int] | tuple[int]   # logical [out, in] or [n]
    stored: str                            # bf16, fp32, int64, fp8 (block scales), fp4 (group scales)
    split: str                             # none, out, in (by TP); vocab (TP over rows); expert
    count: int
    where: str                             # first (stage 0), last (last stage), layer, mtp
    param: bool = True                     # a transformers parameter (False: a buffer, a scale, MTP)


def _linear(name, out, inp, stored, split, count, where, param=True) -> Tensor:
    return Tensor(name=name, shape=(out, inp), stored=stored, split=split, count=count, where=where, param=param)


def _vec(name, n, stored, count, where, split="none", param=True) -> Tensor:
    return Tensor(name=name, shape=(n,), stored=stored, split=split, count=count, where=where, param=param)


def _layer_tensors(model, a: WeightArch, prefix: str, kinds: list[int], hash_layers: int, where: str) -> list[Tensor]:
    """The tensors of the decoder blocks whose compress ratios are `kinds` (one entry per block)."""
    return (_attention(model, a, prefix, kinds, where) + _compressors(model, prefix, kinds, where)
            + _ffn(model, a, prefix, len(kinds), hash_layers, where))


def _attention(model, a: WeightArch, p: str, kinds: list[int], where: str) -> list[Tensor]:
    d, hd, h, n = model.hidden_size, model.head_dim, model.num_attention_heads, len(kinds)
    fp8 = "fp8" if a.fp8_block else "bf16"
    hc = a.hc_mult * (2 + a.hc_mult)
    out = [
        _vec(f"{p}.attn_norm", d, "bf16", n, where), _vec(f"{p}.ffn_norm", d, "bf16", n, where),
        _linear(f"{p}.attn.wq_a", a.q_lora_rank, d, fp8, "none", n, where),
        _vec(f"{p}.attn.q_norm", a.q_lora_rank, "bf16", n, where),
        _linear(f"{p}.attn.wq_b", h * hd, a.q_lora_rank, fp8, "out", n, where),
        _linear(f"{p}.attn.wkv", hd, d, fp8, "none", n, where),
        _vec(f"{p}.attn.kv_norm", hd, "bf16", n, where),
        _linear(f"{p}.attn.wo_a", a.o_groups * a.o_lora_rank, h * hd // a.o_groups, fp8, "out", n, where),
        _linear(f"{p}.attn.wo_b", d, a.o_groups * a.o_lora_rank, fp8, "in", n, where),
        _vec(f"{p}.attn.attn_sink", h, "fp32", n, where, split="out"),
    ]
    for block in ("attn", "ffn"):   # the hyper-connection mixers around each sub-block
        out += [_linear(f"{p}.hc_{block}_fn", hc, a.hc_mult * d, "fp32", "none", n, where),
                _vec(f"{p}.hc_{block}_base", hc, "fp32", n, where), _vec(f"{p}.hc_{block}_scale", 3, "fp32", n, where)]
    c4 = kinds.count(4)
    if c4:
        q = f"{p}.attn.indexer"
        ih, ihd = model.index_n_heads, model.index_head_dim
        out += [_linear(f"{q}.wq_b", ih * ihd, a.q_lora_rank, fp8, "none", c4, where),
                _linear(f"{q}.weights_proj", ih, d, "bf16", "none", c4, where)]
    return out


def _compressors(model, p: str, kinds: list[int], where: str) -> list[Tensor]:
    """C4 layers compress twice (the KV, over overlapping windows: two halves; the indexer keys),
    C128 layers once."""
    d, hd, ihd = model.hidden_size, model.head_dim, model.index_head_dim
    out = []
    for name, ratio, count, width, coff in ((f"{p}.attn.compressor[4]", 4, kinds.count(4), hd, 2),
                                            (f"{p}.attn.compressor[128]", 128, kinds.count(128), hd, 1),
                                            (f"{p}.attn.indexer.compressor", 4, kinds.count(4), ihd, 2)):
        if count:
            out += [_linear(f"{name}.wkv", coff * width, d, "bf16", "none", count, where),
                    _linear(f"{name}.wgate", coff * width, d, "bf16", "none", count, where),
                    _linear(f"{name}.ape", ratio, coff * width, "fp32", "none", count, where),
                    _vec(f"{name}.norm", width, "bf16", count, where)]
    return out


def _ffn(model, a: WeightArch, p: str, n: int, hash_layers: int, where: str) -> list[Tensor]:
    d, inter, e = model.hidden_size, a.moe_intermediate_size, a.n_routed_experts
    fp8 = "fp8" if a.fp8_block else "bf16"
    shared = inter * a.n_shared_experts
    return [
        _linear(f"{p}.ffn.gate", e, d, "bf16", "none", n, where),
        _linear(f"{p}.ffn.shared_experts.w1", shared, d, fp8, "out", n, where),
        _linear(f"{p}.ffn.shared_experts.w3", shared, d, fp8, "out", n, where),
        _linear(f"{p}.ffn.shared_experts.w2", d, shared, fp8, "in", n, where),
        _linear(f"{p}.ffn.experts.w1", inter, d, a.expert_dtype, "expert", n * e, where),
        _linear(f"{p}.ffn.experts.w3", inter, d, a.expert_dtype, "expert", n * e, where),
        _linear(f"{p}.ffn.experts.w2", d, inter, a.expert_dtype, "expert", n * e, where),
        # the router's buffers: hash layers keep a token → expert table, the others a bias
        _linear(f"{p}.ffn.gate.tid2eid", a.vocab_size, a.num_experts_per_tok, "int64", "none", hash_layers, where,
                param=False),
        _vec(f"{p}.ffn.gate.bias", e, "fp32", n - hash_layers, where, param=False),
    ]


def tensors(model, layers=None, *, first: bool = True, last: bool = True, mtp: bool = True) -> list[Tensor]:
    """The checkpoint's tensors for the main layers `layers` (LayerSpecs; default all), the
    embedding when `first`, the head when `last`, and the MTP blocks when `mtp` (and `last`)."""
    a = _arch(model)
    main = [l for l in model.layers() if not l.is_draft] if layers is None else [l for l in layers if not l.is_draft]
    d, v = model.hidden_size, a.vocab_size
    kinds = [l.ratio for l in main]
    hash_layers = sum(1 for l in main if l.index < a.num_hash_layers)
    out = _layer_tensors(model, a, "layers", kinds, hash_layers, "layer") if main else []
    if first:
        out.append(_linear("embed", v, d, "bf16", "vocab", 1, "first"))
    if last:
        out += [_vec("norm", d, "bf16", 1, "last"),
                _linear("hc_head_fn", a.hc_mult, a.hc_mult * d, "fp32", "none", 1, "last"),
                _vec("hc_head_base", a.hc_mult, "fp32", 1, "last"), _vec("hc_head_scale", 1, "fp32", 1, "last")]
        if not a.tie_word_embeddings:
            out.append(_linear("head", v, d, "bf16", "vocab", 1, "last"))
    if mtp and last and model.num_nextn_predict_layers:
        out += _mtp_tensors(model, a, model.num_nextn_predict_layers)
    return out


def _mtp_tensors(model, a: WeightArch, n: int) -> list[Tensor]:
    """Each MTP block: one SWA-only decoder block (top-k routed) plus its input projections and head norm."""
    d, fp8 = model.hidden_size, "fp8" if a.fp8_block else "bf16"
    block = _layer_tensors(model, a, "mtp", [0] * n, 0, "mtp")
    extra = [_linear("mtp.e_proj", d, d, fp8, "none", n, "mtp"), _linear("mtp.h_proj", d, d, fp8, "none", n, "mtp"),
             _vec("mtp.enorm", d, "bf16", n, "mtp"), _vec("mtp.hnorm", d, "bf16", n, "mtp"),
             _vec("mtp.norm", d, "bf16", n, "mtp"),
             _linear("mtp.hc_head_fn", a.hc_mult, a.hc_mult * d, "fp32", "none", n, "mtp"),
             _vec("mtp.hc_head_base", a.hc_mult, "fp32", n, "mtp"), _vec("mtp.hc_head_scale", 1, "fp32", n, "mtp")]
    return [Tensor(name=t.name, shape=t.shape, stored=t.stored, split=t.split, count=t.count, where="mtp",
                   param=False) for t in block + extra]


def _arch(model) -> WeightArch:
    if model.weights is None:
        raise ConfigError("weights_bytes", f"{model.name}'s config has no MoE/vocabulary fields, so its weights are "
                          "unknown", "give weights_bytes=BYTES (the weights' share of one rank), or the budget as "
                          "memory_bytes, or use a released config.json")
    return model.weights


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def shard_shape(t: Tensor, tp: int) -> tuple:
    """The shape one of `tp` ranks holds."""
    if t.split in ("none", "expert") or tp == 1:
        return t.shape
    axis = 1 if t.split == "in" else 0
    shape = list(t.shape)
    if shape[axis] % tp:
        raise ConfigError("tp", f"tp={tp} does not divide {t.name}'s {shape[axis]:,} rows", "pick a tp that divides it")
    shape[axis] //= tp
    return tuple(shape)


def tensor_bytes(t: Tensor, shape: tuple, fp8_block=(FP8_BLOCK, FP8_BLOCK)) -> int:
    """Bytes of one tensor of `shape` as stored: data plus its scales."""
    if t.stored == "fp8":
        out, inp = shape
        return out * inp + cdiv(out, fp8_block[0]) * cdiv(inp, fp8_block[1])
    if t.stored == "fp4":
        out, inp = shape
        return out * inp // 2 + out * cdiv(inp, FP4_GROUP)
    return _numel(shape) * ITEMSIZE[t.stored]


def rank_bytes(t: Tensor, tp: int, fp8_block=(FP8_BLOCK, FP8_BLOCK)) -> int:
    """Bytes of all `count` copies of `t` on one of `tp` ranks. Experts: whole experts spread over
    the ranks (expert parallelism), or each expert split by TP: the same bytes when they divide."""
    if t.split == "expert" and tp > 1:
        if t.count % tp:
            raise ConfigError("tp", f"tp={tp} does not divide the {t.count:,} routed experts' tensors",
                              "pick a tp that divides n_routed_experts")
        return t.count // tp * tensor_bytes(t, t.shape, fp8_block)
    return t.count * tensor_bytes(t, shard_shape(t, tp), fp8_block)


def parameter_count(model) -> int:
    """Parameters as transformers counts them (see the module doc)."""
    return sum(t.count * _numel(t.shape) for t in tensors(model) if t.param)


def checkpoint_bytes(model) -> int:
    """Bytes of every stored tensor, MTP block included: the checkpoint's payload."""
    block = _arch(model).fp8_block or (FP8_BLOCK, FP8_BLOCK)
    return sum(rank_bytes(t, 1, block) for t in tensors(model))


@dataclass(frozen=True, slots=True, kw_only=True)
class RankWeights:
    tp: int
    pp: int
    pp_rank: int
    bytes: int
    by_part: dict       # attention / experts / shared expert / embedding+head / other → bytes
    assumptions: tuple[str, ...]


_PARTS = (("experts", ".ffn.experts."), ("shared expert", ".ffn.shared_experts."), ("attention", ".attn."),
          ("router", ".ffn.gate"), ("hyper-connections", "hc_"))


def _part(name: str) -> str:
    if name in ("embed", "head"):
        return "embedding + head"
    return next((part for part, key in _PARTS if key in name), "norms")


def weights_per_rank(model, tp: int = 1, pp: int = 1, pp_rank: int = 0, layers=None) -> RankWeights:
    """Bytes of the weights one rank holds: its stage's layers (`layers`: the planner's
    rank_layers; default all main layers), split over `tp`."""
    a = _arch(model)
    block = a.fp8_block or (FP8_BLOCK, FP8_BLOCK)
    ts = tensors(model, layers, first=pp_rank == 0, last=pp_rank == pp - 1)
    parts: dict[str, int] = {}
    for t in ts:
        parts[_part(t.name)] = parts.get(_part(t.name), 0) + rank_bytes(t, tp, block)
    return RankWeights(tp=tp, pp=pp, pp_rank=pp_rank, bytes=sum(parts.values()), by_part=parts,
                       assumptions=assumptions(a, tp, pp))


def assumptions(a: WeightArch, tp: int, pp: int) -> tuple[str, ...]:
    stored = (f"attention, indexer wq_b, shared expert, MTP projections fp8 e4m3 with a ue8m0 scale per "
              f"{a.fp8_block[0]}x{a.fp8_block[1]} block" if a.fp8_block else "dense weights bf16")
    expert = {"fp4": "routed experts fp4 (e2m1 two per byte, a ue8m0 scale per 32)",
              "fp8": "routed experts fp8 with block scales", "bf16": "routed experts bf16"}[a.expert_dtype]
    out = [f"{stored}; {expert}; the rest bf16, with fp32 sinks, hyper-connection mixers, positional "
           "biases and router bias, int64 hash-routing tables",
           "the MTP block counted on the last stage (it is loaded with the model)"]
    if tp > 1:
        out.append(f"tp={tp}: query heads, wo, the shared expert and the vocabulary split; the KV head, "
                   "compressors, indexer and router replicated; routed experts split by TP or spread by "
                   "expert parallelism (same bytes)")
    if pp > 1:
        out.append(f"pp={pp}: main layers split evenly, embedding on stage 0, head and MTP on the last")
    out.append("activations, CUDA graphs and the engine's workspace are not weights: leave them room "
               "through --mem-fraction")
    return tuple(out)


def weights_to_dict(w: RankWeights, model) -> dict:
    return {"schema": WEIGHTS_SCHEMA, "schema_version": 1, "model": model.name, "tp": w.tp, "pp": w.pp,
            "pp_rank": w.pp_rank, "bytes": w.bytes, "by_part": dict(w.by_part),
            "checkpoint_bytes": checkpoint_bytes(model), "parameters": parameter_count(model),
            "assumptions": list(w.assumptions)}
