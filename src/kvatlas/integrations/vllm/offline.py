"""vLLM's own KV planner and scheduler (0.33.x and 0.34.x) for DeepSeek-V4, run offline on a CPU. All knowledge of
how to stand vLLM up without a GPU lives here; the plugin (`plugin.py` beside it) and kvatlas's tests
and benchmarks build on it.

What runs is vLLM's code, not a model of it: its `ModelConfig` parses the DeepSeek-V4 config,
vLLM's own per-layer cache modules give their `get_kv_cache_spec` (the model runner's spec loop
included), and `EngineCore.__init__` itself runs the engine-core sequence (`_initialize_kv_caches`:
specs, layout, global groups, `get_kv_cache_configs`, the scheduler's config, the logged "GPU KV
cache size"; then the structured-output manager, the real `Scheduler`/`AsyncScheduler`, its
`KVCacheManager` and the request block hasher). Only the executor is ours (`_OfflineExecutor`): it
stands where the GPU workers would, reporting the layers' specs and the KV budget the profiler
would have measured, and, for each batch, a `ModelRunnerOutput` with the tokens a caller chooses.

Three settings differ from what a CPU-only vLLM would pick by itself, each the CUDA value:
the device is `cuda` (the config is never asked for a tensor), the hybrid KV cache manager is on
(`UnspecifiedPlatform.support_hybrid_kv_cache()` is False only for want of a GPU) and the cache
block is 256 tokens (what the DeepSeek-V4 backends force). The attention module itself builds
tensor-parallel linears and CUDA events, so it is made without its `__init__`, with the four
attributes its `get_kv_cache_spec` reads set as its `__init__` sets them.

Use (in the venv `tests/vllm_plugin/setup_env.sh` builds):

    from kvatlas.integrations import vllm as kv
    eng = kv.build_engine("deepseek-v4-flash", "120GiB", max_num_seqs=64, max_model_len=65536)
    eng.kv_cache_config.num_blocks            # vLLM's KVCacheConfig
    eng.add_request("a", list(range(5000)), max_tokens=8)
    while eng.has_requests():
        eng.step()                            # schedule, "run" the batch, update, make stats

KV events: `build_engine(..., kv_events={"endpoint": "tcp://127.0.0.1:5557"})` turns on the scheduler's
own ZMQ publisher (`KVEventsConfig`); `eng.shutdown()` stops it.

`kv_cache_config(...)` runs only the planner (no scheduler). vLLM 0.33.x and 0.34.x are accepted, with
one API: where 0.34 moved things (the per-layer spec loop now lives in model runner V2's
`attn_utils`; `ModelRunnerOutput` lost its request index) the builder follows the release installed.
"""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import Future
from dataclasses import dataclass, field
from importlib import metadata
from typing import Callable

SUPPORTED_SERIES = ("0.33.", "0.34.")   # the releases whose planner and scheduler kvatlas has read
NEWEST = "0.34"
BLOCK_TOKENS = 256          # the DeepSeek-V4 backends' block: every group's tokens per block
DEFAULT_TOKEN = 1           # what the offline model "samples" unless a caller says otherwise


def vllm_version() -> str | None:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def supported(version: str | None) -> bool:
    return version is not None and version.startswith(SUPPORTED_SERIES)


def series(version: str | None = None) -> str | None:
    """"0.33" or "0.34" for a supported release (the installed one by default), else None."""
    version = vllm_version() if version is None else version
    return version.rsplit(".", 1)[0] if supported(version) else None


def supported_text() -> str:
    return " or ".join(f"{s}x" for s in SUPPORTED_SERIES)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineOptions:
    """The vLLM flags the KV planner and scheduler read (`vllm serve` spelling in the comments).
    None: vLLM's own default (for max_model_len: the model's max_position_embeddings)."""

    max_model_len: int | None = None                    # --max-model-len
    max_num_seqs: int = 256                             # --max-num-seqs
    max_num_batched_tokens: int = 8192                  # --max-num-batched-tokens
    enable_prefix_caching: bool = True                  # --enable-prefix-caching
    prefix_cache_retention_interval: int | None = 0     # --prefix-cache-retention-interval
    async_scheduling: bool = True                       # --async-scheduling
    enable_chunked_prefill: bool = True                 # --enable-chunked-prefill
    num_gpu_blocks_override: int | None = None          # --num-gpu-blocks-override
    log_stats: bool = True                              # not --disable-log-stats
    extensible_kv_cache: bool = False                   # --enable-extensible-kv-cache (0.34; CUDA's default)
    warmup: dict | None = None                          # with it: what the worker measures after warm-up
                                                        # (WARMUP_FIELDS; default: nothing but the cache used)
    kv_events: dict | None = None                       # --kv-events-config: KVEventsConfig's fields (endpoint,
                                                        # replay_endpoint, buffer_steps, hwm, topic, ...); given,
                                                        # events are on and the scheduler publishes them (ZMQ)

    @classmethod
    def of(cls, options: "EngineOptions | None", kwargs: dict) -> "EngineOptions":
        from dataclasses import fields, replace
        from ...errors import ConfigError
        known = {f.name for f in fields(cls)}
        for key in kwargs:
            if key not in known:
                raise ConfigError(key, "is not a vLLM option the offline engine takes",
                                  f"use one of {', '.join(sorted(known))}")
        return replace(options or cls(), **kwargs)


def vllm_config(model, options: EngineOptions | None = None, **kwargs):
    """vLLM's `VllmConfig` for a kvatlas model (a preset name, a config.json or a model directory)."""
    opts = EngineOptions.of(options, kwargs)
    _require_supported()
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    with tempfile.TemporaryDirectory(prefix="kvatlas-vllm-") as tmp:
        model_config = ModelConfig(model=_model_dir(model, tmp), skip_tokenizer_init=True,
                                   max_model_len=opts.max_model_len)
    cache_config = CacheConfig(enable_prefix_caching=opts.enable_prefix_caching,
                               prefix_cache_retention_interval=opts.prefix_cache_retention_interval,
                               num_gpu_blocks_override=opts.num_gpu_blocks_override)
    scheduler_config = SchedulerConfig(max_model_len=model_config.max_model_len, is_encoder_decoder=False,
                                       max_num_seqs=opts.max_num_seqs,
                                       max_num_batched_tokens=opts.max_num_batched_tokens,
                                       enable_chunked_prefill=opts.enable_chunked_prefill,
                                       async_scheduling=opts.async_scheduling)
    config = VllmConfig(model_config=model_config, cache_config=cache_config, scheduler_config=scheduler_config,
                        device_config=DeviceConfig(device="cuda"), kv_events_config=_kv_events_config(opts))
    config.scheduler_config.disable_hybrid_kv_cache_manager = False   # CUDA's answer
    config.cache_config.block_size = BLOCK_TOKENS
    if opts.extensible_kv_cache or opts.warmup is not None:
        _check_extensible(opts)
        config.cache_config.enable_extensible_kv_cache = True         # CUDA's answer (the CPU's is "unsupported")
    return config


# ---- 0.34's extensible KV cache, its own bookkeeping over an offline VMM driver -----------------

WARMUP_FIELDS = ("init_free_memory", "requested_memory", "non_kv_bytes", "transient_peak_bytes",
                 "torch_reserve_growth_bytes")
GRANULE_BYTES = 2 << 20     # CUDA's VMM granularity, the floor vLLM commits in


def _check_extensible(opts: EngineOptions) -> None:
    from ...errors import ConfigError
    if series() != "0.34":
        raise ConfigError("extensible_kv_cache", f"vLLM {vllm_version()} has no extensible KV cache",
                          "use vLLM 0.34 (KVATLAS_VLLM_VERSION=0.34.0 tests/vllm_plugin/setup_env.sh), or drop it")
    if opts.num_gpu_blocks_override is not None:
        raise ConfigError("extensible_kv_cache", "vLLM sizes it from measured memory, which num_gpu_blocks_override "
                          "overrides", "drop one of the two")
    for key, value in (opts.warmup or {}).items():
        if key not in WARMUP_FIELDS:
            raise ConfigError(f"warmup.{key}", "is not a measurement the offline worker takes",
                              f"use some of {', '.join(WARMUP_FIELDS)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"warmup.{key}", f"{value!r} is not a byte count", "give an int >= 0")


class OfflineVmmDriver:
    """Where CUDA's VMM driver would stand under vLLM's `ExtensibleTensor`: reservations and mappings
    recorded, no memory behind them (views of the buffer are meta tensors). Everything above it —
    granules mapped, segments committed, blocks within a budget — is vLLM's own code."""

    def __init__(self) -> None:
        self.next_base = 1 << 40
        self.reserved: dict[int, int] = {}    # base → bytes
        self.mapped: dict[int, int] = {}      # address → bytes
        self.handles = 0

    def ensure_context(self, device_index: int) -> None:
        pass

    def granularity(self, device_index: int) -> int:
        return GRANULE_BYTES

    def reserve(self, size: int) -> int:
        base, self.next_base = self.next_base, self.next_base + size + (1 << 30)
        self.reserved[base] = size
        return base

    def create(self, size: int, device_index: int, export_handle_types: int = 0) -> int:
        self.handles += 1
        return self.handles

    def map(self, address: int, size: int, handle: int) -> None:
        self.mapped[address] = size

    def set_access(self, address: int, size: int, device_index: int) -> None:
        pass

    def unmap(self, address: int, size: int) -> None:
        del self.mapped[address]

    def release(self, handle: int) -> None:
        pass

    def free_reserved(self, address: int, size: int) -> None:
        del self.reserved[address]

    @property
    def mapped_bytes(self) -> int:
        return sum(self.mapped.values())


class _OfflineVmm:
    """A context in which vLLM's extensible tensor uses `driver` and views its bytes as meta tensors."""

    def __init__(self, driver: OfflineVmmDriver) -> None:
        self.driver = driver

    def __enter__(self):
        import torch
        import vllm.utils.extensible_tensor as et
        self.saved = et.get_vmm_driver, et.uint8_tensor_from_ptr
        et.get_vmm_driver = lambda: self.driver
        et.uint8_tensor_from_ptr = lambda ptr, num_bytes, device_index: torch.empty(num_bytes, dtype=torch.uint8,
                                                                                    device="meta")
        return self.driver

    def __exit__(self, *exc) -> None:
        import vllm.utils.extensible_tensor as et
        et.get_vmm_driver, et.uint8_tensor_from_ptr = self.saved


def _kv_events_config(opts: EngineOptions):
    if opts.kv_events is None:
        return None
    from dataclasses import fields
    from vllm.config import KVEventsConfig
    from ...errors import ConfigError
    known = {f.name for f in fields(KVEventsConfig)}
    for key in opts.kv_events:
        if key not in known:
            raise ConfigError(f"kv_events.{key}", "is not a field of vLLM's KVEventsConfig",
                              f"use some of {', '.join(sorted(known))}")
    return KVEventsConfig(**{"enable_kv_cache_events": True, "publisher": "zmq", **opts.kv_events})


def _require_supported() -> None:
    from ...errors import ConfigError
    version = vllm_version()
    if not supported(version):
        raise ConfigError("vllm", f"vLLM {version or '(not installed)'} is not {supported_text()}",
                          "pip install --no-deps vllm==0.34.0 or 0.33.0 (see tests/vllm_plugin/setup_env.sh)")


def _model_dir(model, tmp: str) -> str:
    from ...errors import ConfigError
    from ...planning.model import load_model
    from ..foreign import model_dir
    spec = load_model(model)
    if spec.family != "v4":
        raise ConfigError("model", f"{spec.name} is a {spec.family} model; the offline vLLM engine builds V4 / V4-Pro here",
                          "use a deepseek-v4-flash or deepseek-v4-pro config")
    # the weights' quantization (fp8 blocks, fp4 experts) sets up vLLM's weight kernels, which the KV
    # planner never reads and whose imports a CPU install lacks; the KV cache dtype is separate
    return model_dir(model, tmp, without=("quantization_config",))


# ---- the model's KV cache layers, as vLLM's DeepSeek-V4 modules register them -----------------

def register_layers(config) -> int:
    """Build every DeepSeek-V4 layer's cache modules into `config`'s static forward context, in the
    order `DeepseekV4Attention.__init__` registers them (indexer K cache and its compressor state,
    SWA cache, the attention, the compressor state). Returns the number of modules registered."""
    import torch
    from torch import nn
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v4.attention import DeepseekV4IndexerCache, _resolve_dsv4_kv_cache_dtype
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention as Attention
    from vllm.transformers_utils.deepseek_v4_utils import get_compress_ratios
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache
    hf, cache = config.model_config.hf_config, config.cache_config
    context = config.compilation_config.static_forward_context
    ratios = get_compress_ratios(hf)
    before = len(context)
    with set_current_vllm_config(config):
        for i in range(hf.num_hidden_layers):
            prefix, ratio = f"model.layers.{i}.attn", max(1, ratios[i])
            dtype_str, dtype = _resolve_dsv4_kv_cache_dtype(True, cache.cache_dtype, cache)
            if ratio == 4:   # only C4 layers have the lightning indexer: fp8 K (+ fp32 scale per 128)
                DeepseekV4IndexerCache(head_dim=hf.index_head_dim + hf.index_head_dim // 128 * 4, dtype=torch.uint8,
                                       prefix=f"{prefix}.indexer.k_cache", cache_config=cache, compress_ratio=ratio)
                CompressorStateCache(state_dim=2 * 2 * hf.index_head_dim, dtype=torch.float32, compress_ratio=4,
                                     prefix=f"{prefix}.indexer.compressor.state_cache")
            DeepseekV4SWACache(head_dim=hf.head_dim, window_size=hf.sliding_window, dtype=dtype,
                               prefix=f"{prefix}.swa_cache", cache_config=cache,
                               backend_cls=Attention.swa_backend_cls)
            attention = Attention.__new__(Attention)
            nn.Module.__init__(attention)
            attention.compress_ratio, attention.head_dim = ratio, hf.head_dim
            attention.kv_cache_dtype, attention.kv_cache_torch_dtype = dtype_str, dtype
            context[prefix] = attention
            if ratio > 1:    # overlapping C4 windows keep two rows of state, C128 one
                overlap = 2 if ratio == 4 else 1
                CompressorStateCache(state_dim=2 * overlap * hf.head_dim, dtype=torch.float32, compress_ratio=ratio,
                                     prefix=f"{prefix}.compressor.state_cache")
    return len(context) - before


def layer_specs(config) -> dict:
    """The per-layer KV cache specs, through the model runner's own loop over the forward context
    (the backend's spec customisation included): 0.33's `GPUModelRunner.get_kv_cache_spec`, 0.34's
    (model runner V2 only) `attn_utils.get_kv_cache_spec`."""
    import types
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:   # 0.34
        from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec
        return get_kv_cache_spec(config)
    return GPUModelRunner.get_kv_cache_spec(types.SimpleNamespace(vllm_config=config, shared_kv_cache_layers={}))


# ---- the executor: where the GPU workers would stand ------------------------------------------

Sampler = Callable[[str, int], int]   # (request id, index of the token in its output) -> token id


def _executor_class():
    from vllm.v1.executor.abstract import Executor

    class OfflineExecutor(Executor):
        """One offline worker: the specs of the registered layers, the KV budget as the memory
        profiler would report it, and model outputs: a request whose prompt is computed by the
        end of a batch gets one token (from `sampler`); a partial prefill gets none, as on a GPU."""

        budget_bytes = 0                   # set by build_engine before EngineCore.__init__
        warmup: dict | None = None         # the measurement after warm-up (extensible cache)
        uses_ray = False
        supports_pp = False

        def _init_executor(self) -> None:
            register_layers(self.vllm_config)
            self.worker = _WorkerView(self.vllm_config, self.budget_bytes, self.warmup)
            self.sampler: Sampler = lambda request_id, index: DEFAULT_TOKEN
            self.prompt_tokens: dict[str, int] = {}
            self.output_tokens: dict[str, int] = {}
            self.pending = None

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):
            fn = method if callable(method) else getattr(self.worker, method)
            out = [fn(self.worker, *args, **(kwargs or {})) if callable(method) else fn(*args, **(kwargs or {}))]
            return _done(out) if non_block else out

        def get_kv_cache_specs(self) -> list:
            return [layer_specs(self.vllm_config)]

        def determine_available_memory(self) -> list[int]:
            return [self.budget_bytes]

        # initialize_from_config, compile_or_warm_up_model, extend_kv_cache: vLLM's own Executor
        # methods, whose RPCs reach the worker view

        @property
        def kv_cache_configs(self) -> list:
            return self.worker.kv_cache_configs

        @property
        def extensible_kv_cache(self):
            return self.worker.extensible_kv_cache

        def get_simple_cpu_offload_num_blocks(self):
            return None

        def check_health(self) -> None:
            pass

        def shutdown(self) -> None:
            pass

        def execute_model(self, scheduler_output, non_block=False):
            # as the GPU model runner: None while a sampling step follows, the output itself
            # when nothing was scheduled
            out = self.run_batch(scheduler_output)
            self.pending = None if scheduler_output.total_num_scheduled_tokens == 0 else out
            out = out if self.pending is None else None
            return _done(out) if non_block else out

        def sample_tokens(self, grammar_output, non_block=False):
            out, self.pending = self.pending, None
            return _done(out) if non_block else out

        def take_draft_token_ids(self):
            return None

        def run_batch(self, so):
            from vllm.v1.outputs import ModelRunnerOutput
            for r in so.scheduled_new_reqs:
                self.prompt_tokens[r.req_id] = len(r.prompt_token_ids)
                self.output_tokens.setdefault(r.req_id, 0)
            before = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
            cached = so.scheduled_cached_reqs
            before.update(zip(cached.req_ids, cached.num_computed_tokens))
            ids = list(so.num_scheduled_tokens)
            sampled = []
            for rid in ids:
                done = before[rid] + so.num_scheduled_tokens[rid] >= self.prompt_tokens[rid]
                token = [self.sampler(rid, self.output_tokens[rid])] if done else []
                self.output_tokens[rid] += len(token)
                sampled.append(token)
            for rid in so.finished_req_ids:
                self.prompt_tokens.pop(rid, None)
                self.output_tokens.pop(rid, None)
            fields = ModelRunnerOutput.__dataclass_fields__
            index = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if "req_id_to_index" in fields else {}
            return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **index)   # 0.34 dropped the index

    return OfflineExecutor


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class _WorkerView:
    """What the engine core asks of its workers besides the model: vLLM's own worker methods for
    the KV layout, run over this process's forward context; under 0.34's extensible cache, the
    GPU worker's steps with vLLM's `ExtensibleKVCache` over the offline VMM driver (the engine core
    reaches them through vLLM's own `Executor` methods, as it reaches a GPU worker)."""

    def __init__(self, config, budget_bytes: int = 0, warmup: dict | None = None) -> None:
        self.vllm_config = config
        self.budget_bytes, self.warmup = budget_bytes, warmup
        self.vmm = OfflineVmmDriver()
        self.extensible_kv_cache = None          # vLLM's ExtensibleKVCache, when the cache is extensible
        self.measured_bytes: int | None = None   # what measure_kv_cache_bytes gave
        self.extensions: list[tuple[int, int, int]] = []   # (asked, committed blocks, physical bytes)
        self.kv_cache_configs: list = []

    def initialize_from_config(self, kv_cache_configs) -> None:
        """A GPU worker allocates these tensors; under the extensible cache it reserves them (`reserve`)."""
        self.kv_cache_configs = list(kv_cache_configs)
        if getattr(self.vllm_config.cache_config, "enable_extensible_kv_cache", False):   # 0.34
            self.reserve(self.kv_cache_configs[0])

    def reserve(self, kv_cache_config) -> None:
        """As the GPU worker's `initialize_from_config`: segments padded to the granule, the address
        range reserved and the minimum committed."""
        import torch
        from vllm.v1.worker.extensible_kv_cache import ExtensibleKVCache, pad_kv_cache_segments
        layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
        config = pad_kv_cache_segments(kv_cache_config, layout, GRANULE_BYTES)
        with _OfflineVmm(self.vmm):
            self.extensible_kv_cache = ExtensibleKVCache(config, torch.device("cuda", 0), layout)
            self.extensible_kv_cache.allocate(self.extensible_kv_cache.size)

    def extensible_kv_cache_unsupported_reason(self):
        return None                              # the offline driver backs it

    def compile_or_warm_up_model(self):
        """No model to warm up; under the extensible cache, the worker's measurement after it:
        vLLM's `measure_kv_cache_bytes` on the memory `warmup` describes, in blocks."""
        from vllm.v1.worker.worker_base import CompilationTimes
        cache = self.extensible_kv_cache
        if cache is None:
            return CompilationTimes(language_model=0.0, encoder=0.0)
        from vllm.v1.worker.extensible_kv_cache import measure_kv_cache_bytes
        w = {"init_free_memory": self.budget_bytes, "requested_memory": None, "non_kv_bytes": 0,
             "transient_peak_bytes": 0, "torch_reserve_growth_bytes": 0, **(self.warmup or {})}
        committed = cache.physical_bytes
        self.measured_bytes = measure_kv_cache_bytes(
            init_free_memory=w["init_free_memory"], free_memory=w["init_free_memory"] - w["non_kv_bytes"] - committed,
            committed_bytes=committed,
            requested_memory=w["init_free_memory"] if w["requested_memory"] is None else w["requested_memory"],
            transient_peak_bytes=w["transient_peak_bytes"], torch_reserve_growth_bytes=w["torch_reserve_growth_bytes"])
        return CompilationTimes(language_model=0.0, encoder=0.0, num_kv_blocks=cache.blocks_within(self.measured_bytes))

    def extend_kv_cache(self, num_blocks: int) -> None:
        """The worker's commit of the final size (vLLM's `ExtensibleKVCache.commit`, as its
        `extend_kv_cache` calls it); each call is recorded in `extensions`."""
        cache = self.extensible_kv_cache
        with _OfflineVmm(self.vmm):
            cache.commit(num_blocks, shrink=True)
        self.extensions.append((num_blocks, cache.num_committed_blocks, cache.physical_bytes))

    def get_supported_kv_cache_layouts(self) -> list[str]:
        from vllm.v1.worker.worker_base import WorkerBase
        return WorkerBase.get_supported_kv_cache_layouts(self)

    def set_kv_cache_layout(self, name: str, interleave: int) -> None:
        from vllm.v1.worker.worker_base import WorkerBase
        WorkerBase.set_kv_cache_layout(self, name, interleave)

    def __getattr__(self, name):
        # RPCs with nothing to do offline (e.g. update_max_model_len after auto-fit)
        return lambda *args, **kwargs: None


# ---- the engine ----------------------------------------------------------------------------------

@dataclass(slots=True, kw_only=True)
class OfflineEngine:
    """vLLM's `EngineCore` over the offline executor. `step()` is the engine core's own step."""

    core: object
    options: EngineOptions
    budget_bytes: int
    outputs: list = field(default_factory=list)   # every EngineCoreOutputs step() produced

    @property
    def vllm_config(self):
        return self.core.vllm_config

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv_cache_manager(self):
        return self.core.scheduler.kv_cache_manager

    @property
    def block_pool(self):
        return self.core.scheduler.kv_cache_manager.block_pool

    @property
    def kv_cache_config(self):
        """The scheduler's KVCacheConfig (what `_initialize_kv_caches` returned)."""
        return self.core.scheduler.kv_cache_config

    @property
    def extensible_kv_cache(self):
        """vLLM's ExtensibleKVCache the offline worker built (0.34, extensible_kv_cache=True), or None."""
        return self.core.model_executor.extensible_kv_cache

    @property
    def worker_kv_cache_configs(self) -> list:
        """The per-worker configs the engine core handed to `initialize_from_config`."""
        return self.core.model_executor.kv_cache_configs

    def set_sampler(self, sampler: Sampler) -> None:
        """Choose the token every request "samples": `sampler(request_id, output_index) -> id`."""
        self.core.model_executor.sampler = sampler

    def make_request(self, request_id: str, prompt_token_ids: list[int], max_tokens: int = 16):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling_params=params,
                       pooling_params=None, block_hasher=self.core.request_block_hasher)

    def add_request(self, request_id: str, prompt_token_ids: list[int], max_tokens: int = 16):
        """Queue a request through `EngineCore.add_request`; it ends after `max_tokens` outputs."""
        request = self.make_request(request_id, prompt_token_ids, max_tokens)
        self.core.add_request(request)
        return request

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort_requests(list(request_ids))

    def shutdown(self) -> None:
        """Stop what the scheduler started (the KV event publisher's thread and sockets)."""
        self.core.scheduler.shutdown()

    def has_requests(self) -> bool:
        return self.core.scheduler.has_requests()

    def step(self) -> bool:
        """One engine-core step (the batch-queue variant under async scheduling). Returns whether
        a batch ran."""
        outputs, ran = self.core.step_fn()
        if outputs:
            self.outputs.extend(outputs.values())
        self.core.post_step(ran)
        return ran

    def run(self, max_steps: int = 100_000) -> int:
        """Step until no request is left; returns the steps taken."""
        for n in range(max_steps):
            if not self.has_requests():
                return n
            self.step()
        raise RuntimeError(f"requests still running after {max_steps} steps")

    def last_stats(self):
        """The SchedulerStats of the latest step that made some."""
        for out in reversed(self.outputs):
            if out.scheduler_stats is not None:
                return out.scheduler_stats
        return None


def build_engine(model, memory, options: EngineOptions | None = None, **kwargs) -> OfflineEngine:
    """vLLM's engine core for `model` with `memory` bytes (an int or "120GiB") for the KV cache:
    what its memory profiler would report as available (or `--kv-cache-memory-bytes`)."""
    from ...units import parse_bytes
    opts = EngineOptions.of(options, kwargs)
    budget = parse_bytes(memory)
    config = vllm_config(model, opts)
    from vllm.v1.engine.core import EngineCore
    executor = type("OfflineExecutor", (_executor_class(),), {"budget_bytes": budget, "warmup": opts.warmup})
    core = EngineCore(config, executor, log_stats=opts.log_stats)
    return OfflineEngine(core=core, options=opts, budget_bytes=budget)


def kv_cache_config(model, memory, options: EngineOptions | None = None, **kwargs):
    """Only the planner: the scheduler's KVCacheConfig vLLM builds for `model` and `memory`, through
    `EngineCore._initialize_kv_caches` itself, with no scheduler. Returns (config, VllmConfig)."""
    from ...units import parse_bytes
    opts = EngineOptions.of(options, kwargs)
    config = vllm_config(model, opts)
    from vllm.v1.engine.core import EngineCore
    executor = type("OfflineExecutor", (_executor_class(),), {"budget_bytes": parse_bytes(memory),
                                                              "warmup": opts.warmup})
    core = EngineCore.__new__(EngineCore)
    core.vllm_config, core.model_executor = config, executor(config)
    core.available_gpu_memory_for_kv_cache = -1
    return core._initialize_kv_caches(config), config
