"""DeepSeek-V4 family model specs, loaded from a HF config.json or a bundled preset."""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass
import os

from ..checks import MAX_COUNT
from ..errors import ConfigError
from .weights import WeightArch, arch_from_config


class LayerKind(str, enum.Enum):
    """What one attention layer caches (SPEC §1)."""

    SWA = "swa"        # ratio 0: sliding window only
    C4 = "c4"          # ratio 4: overlapped compression + lightning indexer
    C128 = "c128"      # ratio 128: plain compression
    R2 = "r2"          # V4.1 CSA2 encoder, ratio 2
    R1 = "r1"          # V4.1 CSA2 decoder, ratio 1

    @property
    def ratio(self) -> int:
        return _RATIO[self]

    @property
    def has_indexer(self) -> bool:
        """C4 and the V4.1 low-ratio layers keep lightning-indexer keys beside their compressed KV."""
        return self in (LayerKind.C4, LayerKind.R2, LayerKind.R1)


_RATIO = {LayerKind.SWA: 0, LayerKind.C4: 4, LayerKind.C128: 128, LayerKind.R2: 2, LayerKind.R1: 1}
_KIND_OF_RATIO = {0: LayerKind.SWA, 4: LayerKind.C4, 128: LayerKind.C128}
_V41_KIND_OF_RATIO = {0: LayerKind.SWA, 2: LayerKind.R2, 1: LayerKind.R1}


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerSpec:
    index: int
    kind: LayerKind
    is_draft: bool
    stores_compressed: bool  # V4.1: only kv_source layers hold compressed KV + indexer K

    @property
    def ratio(self) -> int:
        return self.kind.ratio


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    name: str
    family: str                       # "v4" or "v4.1"
    num_hidden_layers: int
    compress_ratios: tuple[int, ...]  # main layers then draft (MTP) layers
    hidden_size: int
    num_attention_heads: int
    head_dim: int
    rope_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    sliding_window: int
    max_position_embeddings: int
    num_nextn_predict_layers: int
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    weights: WeightArch | None = None   # what the weights need (V4 configs with MoE fields); None: unknown
    # what the model is, not what it is called: 32 hex digits of a hash of the canonical form of
    # the whole config it came from (config_digest); two models whose digests differ never share KV
    config_digest: str = ""

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def num_draft_layers(self) -> int:
        return len(self.compress_ratios) - self.num_hidden_layers

    def layers(self, *, draft: bool = False) -> tuple[LayerSpec, ...]:
        """The attention layers, main ones first; draft layers only when asked."""
        table = _V41_KIND_OF_RATIO if self.family == "v4.1" else _KIND_OF_RATIO
        sources = set(self.kv_source_layer_ids)
        out = []
        for i, ratio in enumerate(self.compress_ratios):
            is_draft = i >= self.num_hidden_layers
            if is_draft and not draft:
                continue
            kind = table[ratio]
            stores = kind is not LayerKind.SWA and (self.family != "v4.1" or i in sources)
            out.append(LayerSpec(index=i, kind=kind, is_draft=is_draft, stores_compressed=stores))
        return tuple(out)

    def count(self, kind: LayerKind, *, draft: bool = False) -> int:
        return sum(1 for layer in self.layers(draft=draft) if layer.kind is kind)


def _need(cfg: dict, key: str, where: str, low: int = 0, default=None):
    """A whole number in [low, MAX_COUNT]; `default` is used where the key is absent (None: required)."""
    if key not in cfg and default is None:
        raise ConfigError(f"{where}.{key}", "is missing", "use a DeepSeek-V4 family config.json")
    value = cfg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= MAX_COUNT:
        what = "a positive integer" if low == 1 else "a non-negative integer"
        raise ConfigError(f"{where}.{key}", f"{_short(value)} is not {what} (at most {MAX_COUNT:,})",
                          "fix the value in config.json")
    return value


MAX_LAYERS = 4096   # DeepSeek-V4-Pro has 61 (+1 MTP); a list past this is not a layer list


def _ints(cfg: dict, key: str, where: str) -> tuple[int, ...]:
    value = cfg.get(key, [])
    if isinstance(value, list) and len(value) > MAX_LAYERS:
        raise ConfigError(f"{where}.{key}", f"has {len(value):,} entries, more than {MAX_LAYERS:,} layers",
                          "fix the list in config.json (one entry per layer)")
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"{where}.{key}", f"{_short(value)} is not a list of integers", "fix the list in config.json")
    return tuple(value)


def _short(value) -> str:
    """A config value quoted in a one-line error: a long list is cut, not printed whole."""
    r = repr(value)
    return r if len(r) <= 80 else r[:60] + f"… ({len(r):,} characters)"


# transformers' DeepseekV4Config names each layer's attention instead of its ratio
_TRANSFORMERS_LAYER_TYPES = {"sliding_attention": None, "compressed_sparse_attention": 4,
                             "heavily_compressed_attention": 128}


def _from_layer_types(cfg: dict, where: str) -> dict:
    """A transformers DeepseekV4Config (layer_types, compress_rates, partial_rotary_factor) as the
    released config.json spells it: compress_ratios (draft layers appended as 0) and qk_rope_head_dim."""
    types, rates = cfg["layer_types"], cfg.get("compress_rates") or {}
    if not isinstance(types, list) or not isinstance(rates, dict):
        raise ConfigError(f"{where}.layer_types", f"{types!r} is not a list of layer types", "fix the config")
    ratios = []
    for t in types:
        if t not in _TRANSFORMERS_LAYER_TYPES:
            raise ConfigError(f"{where}.layer_types", f"has {t!r}", f"use only {', '.join(_TRANSFORMERS_LAYER_TYPES)}")
        default = _TRANSFORMERS_LAYER_TYPES[t]
        ratios.append(0 if default is None else rates.get(t, default))
    out = {**cfg, "compress_ratios": ratios + [0] * _need(cfg, "num_nextn_predict_layers", where, 0, 0)}
    factor, head = cfg.get("partial_rotary_factor"), cfg.get("head_dim")
    if "qk_rope_head_dim" not in out and isinstance(factor, (int, float)) and isinstance(head, int):
        out["qk_rope_head_dim"] = int(head * factor)
    return out


def config_digest(cfg: dict) -> str:
    """The model's identity: 32 hex digits of BLAKE2b over the config's canonical form (JSON with
    sorted keys, no spaces, ASCII only) — every field, since any of them (hidden size, vocabulary,
    rope theta, dtype, the weights' revision `_commit_hash` where a transformers config carries
    it, ...) changes the KV a model computes. The same config in any folder, under any name, is
    the same model; a fine-tune whose config.json differs from its base's in any byte of content
    is another."""
    text = json.dumps(cfg, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def model_from_config(cfg: dict, name: str = "custom") -> ModelSpec:
    """Build a ModelSpec from a parsed HF config (V4.1 nests the text model under text_config)."""
    if not isinstance(cfg, dict):
        raise ConfigError("config", "is not a JSON object", "give a HF config.json")
    digest = config_digest(cfg)
    where = "config"
    if isinstance(cfg.get("text_config"), dict):
        cfg, where = cfg["text_config"], "config.text_config"
    if "compress_ratios" not in cfg and "layer_types" in cfg:
        cfg = _from_layer_types(cfg, where)
    if "compress_ratios" not in cfg:
        raise ConfigError(f"{where}.compress_ratios", "is missing",
                          "this is not a DeepSeek-V4 family config (it needs compress_ratios or layer_types)")
    ratios = _ints(cfg, "compress_ratios", where)
    layers = _need(cfg, "num_hidden_layers", where, 1)
    v41 = any(r in (1, 2) for r in ratios) or "kv_source_layer_ids" in cfg
    family = "v4.1" if v41 else "v4"
    allowed = set(_V41_KIND_OF_RATIO if v41 else _KIND_OF_RATIO)
    bad = sorted(set(ratios) - allowed)
    if bad:
        raise ConfigError(f"{where}.compress_ratios", f"has ratios {_short(bad)} not used by {family} models",
                          f"use only {sorted(allowed)}")
    if len(ratios) < layers or layers == 0:
        raise ConfigError(f"{where}.compress_ratios", f"has {len(ratios)} entries for {layers} layers",
                          "give one entry per layer (draft layers appended)")
    if any(r != 0 for r in ratios[layers:]):
        raise ConfigError(f"{where}.compress_ratios", "draft (MTP) layers beyond num_hidden_layers must be 0",
                          "draft layers are SWA-only")
    sources = _ints(cfg, "kv_source_layer_ids", where)
    if v41 and not sources:
        raise ConfigError(f"{where}.kv_source_layer_ids", "is missing", "V4.1 configs name the layers that store compressed KV")
    if any(not 0 <= s < layers or ratios[s] == 0 for s in sources):
        raise ConfigError(f"{where}.kv_source_layer_ids", f"{_short(list(sources))} names layers without compression",
                          "list only compressed layers")
    head_dim = _need(cfg, "head_dim", where, 1)
    rope = _need(cfg, "qk_rope_head_dim", where)
    window = _need(cfg, "sliding_window", where)
    if rope >= head_dim or window == 0:
        raise ConfigError(f"{where}.head_dim", f"head_dim {head_dim}, rope {rope}, window {window} are inconsistent",
                          "head_dim must exceed qk_rope_head_dim and sliding_window must be positive")
    return ModelSpec(
        name=name, family=family, num_hidden_layers=layers, compress_ratios=ratios,
        hidden_size=_need(cfg, "hidden_size", where, 1), num_attention_heads=_need(cfg, "num_attention_heads", where, 1),
        head_dim=head_dim, rope_head_dim=rope, index_n_heads=_need(cfg, "index_n_heads", where, 0, 0),
        index_head_dim=_need(cfg, "index_head_dim", where, 1, 128), index_topk=_need(cfg, "index_topk", where, 0, 0),
        sliding_window=window, max_position_embeddings=_need(cfg, "max_position_embeddings", where, 1),
        num_nextn_predict_layers=_need(cfg, "num_nextn_predict_layers", where, 0, 0),
        kv_source_layer_ids=sources, index_source_layer_ids=_ints(cfg, "index_source_layer_ids", where),
        # V4.1's weights (engrams, shared KV sources) are another structure: not derived
        weights=None if v41 else arch_from_config(cfg, where), config_digest=digest,
    )


# plain os.path: importlib.resources and pathlib cost 15 ms of a 60 ms `kvatlas plan`
PRESET_DIR = os.path.join(os.path.dirname(__file__), "presets")
_MAX_CONFIG_BYTES = 16 * 2**20   # HF configs are a few KiB; past this the read stops


def preset_names() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".json"))


def load_model(name_or_path) -> ModelSpec:
    """A preset name, a config.json file, a model directory holding one, a parsed config (dict) or
    a config object with to_dict() (a transformers DeepseekV4Config: `load_model(model.config)`)."""
    if isinstance(name_or_path, dict):
        return model_from_config(name_or_path)
    if callable(getattr(name_or_path, "to_dict", None)) and not isinstance(name_or_path, (str, os.PathLike)):
        cfg = dict(name_or_path.to_dict())
        cfg.pop("_name_or_path", None)   # where the object was loaded from, not what it is
        return model_from_config(cfg, name=str(getattr(name_or_path, "_name_or_path", "") or cfg.get("model_type")
                                               or "custom"))
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ConfigError("model", f"{name_or_path!r} is not a name or a path",
                          f"use one of {', '.join(preset_names())}, a config.json or a model directory")
    text = os.fspath(name_or_path)
    if not text or "\0" in text:
        raise ConfigError("model", f"{text!r} is not a name or a path", f"use one of {', '.join(preset_names())}")
    if text in preset_names():
        with open(os.path.join(PRESET_DIR, f"{text}.json")) as f:
            return model_from_config(json.load(f), name=text)
    path = os.path.join(text, "config.json") if os.path.isdir(text) else text
    if not os.path.isfile(path):
        raise ConfigError("model", f"{text!r} is neither a preset nor a config.json",
                          f"use one of {', '.join(preset_names())}, a config.json or a model directory")
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError("model", f"cannot read {path} ({exc.strerror or exc})", "give a readable config.json") from None
    if len(data) > _MAX_CONFIG_BYTES:   # said as such: cut short, it would read as "not valid JSON"
        raise ConfigError("model", f"{path} is more than the {_MAX_CONFIG_BYTES // 2**20} MiB a config.json may be "
                          "(HF configs are a few KiB)", "give the model's config.json, not a weights or data file")
    try:
        cfg = json.loads(data.decode("utf-8-sig"))   # utf-8-sig: a byte-order mark some editors write
    except (ValueError, RecursionError) as exc:   # JSONDecodeError, UnicodeDecodeError, too deep
        raise ConfigError("model", f"{path} is not valid JSON ({str(exc)[:120]})", "give a HF config.json") from None
    base = os.path.basename(path)
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) if base == "config.json" else base.rsplit(".", 1)[0]
    return model_from_config(cfg, name=name)
