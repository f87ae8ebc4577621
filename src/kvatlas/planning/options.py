"""Serving options: the deployment a plan is made for, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from . import formats
from .stages import rank_layers
from .weights import weights_per_rank
from ..checks import MAX_BYTES, boolean, real, whole
from ..errors import ConfigError
from ..units import fmt_bytes, parse_bytes

# Total memory CUDA reports for each GPU (nvidia-smi's MiB figure).
GPU_MEMORY_BYTES = {"h200": 143771 * 2**20, "h100": 81559 * 2**20, "h20": 97871 * 2**20, "b200": 183359 * 2**20}
# Each GPU's architecture: engines gate kernels on it (vLLM's fp4 indexer needs Blackwell)
GPU_ARCH = {"h200": "hopper", "h100": "hopper", "h20": "hopper", "b200": "blackwell"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeOptions:
    memory_bytes: int | None = None       # KV budget per rank; None: gpu × mem_fraction − weights
    gpu: str = "h200"
    mem_fraction: float = 0.9
    weights_bytes: int | str = 0          # the weights' share of one rank's memory; "auto": from the config
                                          # (planning.weights), filled in by resolve() when memory is None
    weights_from_config: bool = False     # set by resolve(): weights_bytes came from the config
    page_tokens: int = 256
    swa_page_tokens: int = 64             # SWA pages are smaller: a 128-token window in 256-token
                                          # pages holds 2 pages (512 tokens) per request
    kv_layout: str | None = None          # None: the model family's native layout
    indexer: str | None = None            # None: the layout's default
    state_dtype: str = "fp32"
    online_c128: bool = False
    max_running_requests: int = 256
    draft_tokens: int = 0
    chunked_prefill_tokens: int = 8192
    draft_layers: bool | None = None      # None: cached iff draft_tokens > 0
    max_model_len: int | None = None      # None: the model's max_position_embeddings
    tp: int = 1
    pp: int = 1
    dp: int = 1
    pp_rank: int = 0
    prefix_checkpoints: int = 0           # resume points the prefix cache may keep; 0: no prefix cache

    @classmethod
    def from_kwargs(cls, **kwargs) -> "ServeOptions":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(unknown[0], "is not a serving option", f"use one of {', '.join(sorted(known))}")
        if isinstance(kwargs.get("memory_bytes"), str):
            kwargs["memory_bytes"] = parse_bytes(kwargs["memory_bytes"], "memory_bytes")
        if isinstance(kwargs.get("weights_bytes"), str) and kwargs["weights_bytes"] != "auto":
            kwargs["weights_bytes"] = parse_bytes(kwargs["weights_bytes"], "weights_bytes")
        opts = cls(**kwargs).validated()
        if opts.memory_bytes is not None:
            _beside_memory(opts, kwargs)
        return opts

    def validated(self) -> "ServeOptions":
        _positive_int(self, "page_tokens", "swa_page_tokens", "max_running_requests", "chunked_prefill_tokens", "tp", "pp", "dp")
        _non_negative_int(self, "draft_tokens", "pp_rank", "prefix_checkpoints")
        if self.weights_bytes != "auto":
            whole("weights_bytes", self.weights_bytes, 0, MAX_BYTES)
        if self.memory_bytes is not None:
            whole("memory_bytes", self.memory_bytes, 1, MAX_BYTES)
        if self.max_model_len is not None:
            _positive_int(self, "max_model_len")
        if self.page_tokens % 128:
            raise ConfigError("page_tokens", f"{self.page_tokens} is not a multiple of 128",
                              "use 256 (the C128 pool needs whole entries per page)")
        if self.swa_page_tokens % 64:
            raise ConfigError("swa_page_tokens", f"{self.swa_page_tokens} is not a multiple of 64",
                              "use 64 (the attention kernels read 64-entry blocks)")
        if self.prefix_checkpoints and self.page_tokens % self.swa_page_tokens:
            raise ConfigError("swa_page_tokens", f"{self.swa_page_tokens} does not divide page_tokens={self.page_tokens}",
                              "use 64 with the prefix cache (a cached page must end on an SWA page boundary)")
        if self.pp_rank >= self.pp:
            raise ConfigError("pp_rank", f"{self.pp_rank} is not below pp={self.pp}", "pick a rank in 0..pp-1")
        _names(self, "gpu", "kv_layout", "indexer", "state_dtype")
        if self.gpu not in GPU_MEMORY_BYTES:
            raise ConfigError("gpu", f"{self.gpu!r} is not known",
                              f"use one of {', '.join(GPU_MEMORY_BYTES)} or give memory_bytes")
        real("mem_fraction", self.mem_fraction, 0.0, 1.0, open_low=True)
        boolean("online_c128", self.online_c128)
        if self.draft_layers is not None:
            boolean("draft_layers", self.draft_layers)
        if self.kv_layout is not None:
            formats.layout(self.kv_layout)
        if self.indexer is not None:
            formats.indexer_format(self.indexer)
        formats.state_itemsize(self.state_dtype)
        if self.online_c128 and self.state_dtype != "fp32":
            raise ConfigError("online_c128", "online C128 state needs fp32 (running max and sum)",
                              "use state_dtype fp32 or turn online_c128 off")
        return self

    def resolve(self, model) -> "ServeOptions":
        """Fill the defaults that depend on the model and check the pairing."""
        native = "v4.1" if model.family == "v4.1" else "v4"
        kv_layout = self.kv_layout or native
        lay = formats.layout(kv_layout)
        if lay.family != model.family:
            choices = [n for n, l in formats.LAYOUTS.items() if l.family == model.family]
            raise ConfigError("kv_layout", f"{kv_layout!r} does not fit a {model.family} model",
                              f"use one of {', '.join(choices)}")
        formats.check_dims(model, lay, formats.indexer_format(self.indexer or lay.default_indexer))
        max_len = self.max_model_len or model.max_position_embeddings
        _deployable(self, model, max_len)
        draft_layers = self.draft_tokens > 0 if self.draft_layers is None else self.draft_layers
        out = replace(self, kv_layout=kv_layout, indexer=self.indexer or lay.default_indexer,
                      max_model_len=max_len, draft_layers=draft_layers)
        if self.weights_bytes == "auto":
            # with a KV budget given the weights do not enter it; else the config says what they take
            auto = self.memory_bytes is None
            out = replace(out, weights_bytes=self.auto_weights(model, out).bytes if auto else 0,
                          weights_from_config=auto)
            if auto:
                out._fits_beside_weights(model)
        return out

    def _fits_beside_weights(self, model) -> None:
        """Refuse, naming the smallest tp that fits, a GPU share the weights fill."""
        share = int(GPU_MEMORY_BYTES[self.gpu] * self.mem_fraction)
        if self.weights_bytes < share:
            return
        fits = None
        for tp in (2, 4, 8, 16, 32, 64):
            try:
                if tp > self.tp and self.auto_weights(model, replace(self, tp=tp)).bytes < share:
                    fits = tp
                    break
            except ConfigError:   # this tp does not divide the heads or experts
                continue
        hint = f"use tp={fits} or more" if fits else "raise pp"
        raise ConfigError("weights_bytes", f"{model.name}'s weights take {self.weights_bytes:,} B per rank at "
                          f"tp={self.tp} pp={self.pp}, all of the {share:,} B that mem_fraction={self.mem_fraction:g} "
                          f"gives on one {self.gpu}", f"{hint}, or give the KV budget as memory_bytes")

    def auto_weights(self, model, resolved: "ServeOptions"):
        """What one rank of this deployment holds in weights (planning.weights)."""
        return weights_per_rank(model, resolved.tp, resolved.pp, resolved.pp_rank, rank_layers(model, resolved))

    def budget_bytes(self) -> int:
        if self.memory_bytes is not None:
            return self.memory_bytes
        if self.weights_bytes == "auto":
            raise ConfigError("weights_bytes", "'auto' is filled in from the model", "resolve the options first")
        usable = int(GPU_MEMORY_BYTES[self.gpu] * self.mem_fraction) - self.weights_bytes
        if usable <= 0:
            have = int(GPU_MEMORY_BYTES[self.gpu] * self.mem_fraction)
            raise ConfigError("weights_bytes", f"weights of {self.weights_bytes:,} B per rank (tp={self.tp}, pp={self.pp}) "
                              f"leave nothing of the {have:,} B that mem_fraction={self.mem_fraction:g} gives on one "
                              f"{self.gpu}", "raise tp or pp (fewer weights per rank), lower weights_bytes, or give memory_bytes")
        return usable

    @property
    def running_requests_per_rank(self) -> int:
        return -(-self.max_running_requests // self.dp)


def _beside_memory(opts: ServeOptions, given: dict) -> None:
    """memory_bytes IS the KV budget: options that only shape a GPU-derived budget would be
    ignored beside it, and a budget larger than the GPU named cannot exist."""
    if given.get("weights_bytes"):
        raise ConfigError("weights_bytes", "given beside memory_bytes, which is the KV budget itself",
                          "drop weights_bytes (it applies to budgets made from a gpu: its memory × mem_fraction − "
                          "weights_bytes) or drop memory_bytes")
    if "mem_fraction" in given:
        raise ConfigError("mem_fraction", "given beside memory_bytes, which is the KV budget itself",
                          "drop mem_fraction (it applies to gpu budgets) or drop memory_bytes")
    if "gpu" in given and opts.memory_bytes > GPU_MEMORY_BYTES[opts.gpu]:
        have = GPU_MEMORY_BYTES[opts.gpu]
        bigger = [g for g, n in sorted(GPU_MEMORY_BYTES.items(), key=lambda x: x[1]) if n >= opts.memory_bytes]
        raise ConfigError("memory_bytes", f"{fmt_bytes(opts.memory_bytes)} is more than the whole {opts.gpu} "
                          f"({fmt_bytes(have)}, {have:,} B)", f"give at most {have:,} B"
                          + (f", or name a GPU that holds it (gpu={bigger[0]})" if bigger else ""))


def _deployable(opts: ServeOptions, model, max_len: int) -> None:
    """Deployments that cannot exist: more stages than layers, a tensor split that does not
    divide the heads, data-parallel ranks without a request, a context beyond the model's."""
    if max_len > model.max_position_embeddings:
        raise ConfigError("max_model_len", f"{max_len:,} tokens is beyond the model's context "
                          f"(max_position_embeddings {model.max_position_embeddings:,})",
                          f"give at most {model.max_position_embeddings:,}")
    main = model.num_hidden_layers
    if opts.pp > main:
        raise ConfigError("pp", f"{opts.pp} pipeline stages for {main} layers leave stages without a layer",
                          f"use pp ≤ {main}")
    heads = model.num_attention_heads
    if opts.tp > heads or heads % opts.tp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        shown = ", ".join(map(str, divisors[:12])) + (", …" if len(divisors) > 12 else "")
        raise ConfigError("tp", f"{opts.tp} does not divide the model's {heads} attention heads",
                          f"use a divisor of {heads}: {shown}")
    if opts.dp > opts.max_running_requests:
        raise ConfigError("dp", f"{opts.dp} data-parallel ranks for max_running_requests={opts.max_running_requests} "
                          "leave ranks without a request", f"use dp ≤ {opts.max_running_requests} or raise "
                          "max_running_requests (it counts requests of all ranks)")


def _positive_int(opts, *names):
    for name in names:
        whole(name, getattr(opts, name), 1)


def _non_negative_int(opts, *names):
    for name in names:
        whole(name, getattr(opts, name), 0)


def _names(opts, *fields_):
    """Choices are looked up by name: a list or a number would fail deep in a dict lookup."""
    for name in fields_:
        value = getattr(opts, name)
        if value is not None and not isinstance(value, str):
            raise ConfigError(name, f"{value!r} is not a name", "give the choice as a string, e.g. the CLI's spelling")
