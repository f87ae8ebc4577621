"""SGLang plugin: a DeepSeek-V4 server reports its KV cache truthfully. All SGLang knowledge lives here.

`pip install 'kvatlas[sglang]'` registers `register()` in the entry-point group `sglang.srt.plugins`;
SGLang's `load_plugins()` calls it early in every process it starts. It only registers hooks
(SGLang's `HookRegistry` applies them) and imports nothing heavy: prometheus_client must not be
imported before SGLang sets PROMETHEUS_MULTIPROC_DIR, which the launcher does after loading plugins.

The hooks, and why these (the narrowest that see everything needed):
- AFTER `KVCacheConfigurator._init_pools`: the one call that returns the request table, the KV pool
  and the allocator together, after the allocator's __init__ has registered its full→SWA index map
  on the pool (a hook on the pool's __init__ would miss that map: 4,435,976 B for V4-Flash at
  4 GiB) and before the scheduler emits `mem_usage` as `sglang:kv_cache_memory_usage_gb`. Here
  the pools are audited, `mem_usage` is set (GB = bytes / 2^30), one line is logged, gauges written.
- AFTER `DSV4PoolConfigurator.calculate_pool_sizes`: the budget the pools were sized from and the
  configurator's own prices per token: the `planned` measure and "bytes over budget".
- AFTER `SchedulerMetricsCollector.log_stats`: SGLang's own stats cadence refreshes the occupancy,
  on the scheduler thread that owns the allocators (no thread of ours, no race). A refresh reads
  three O(1) allocator counters and writes one gauge per pool and measure: bounded, whatever the
  number of requests. Ranks SGLang does not collect stats on (tp_rank > 0 unless
  --enable-metrics-for-all-schedulers) keep their start-up values.

Only SGLang 0.5.23 is known: any other version (or none) gets one log line and no hook at all.
Every hook catches its own errors: a failure logs one line and leaves SGLang exactly as it was.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass
from importlib import metadata

from . import prefix as sglang_prefix
from ..foreign import model_dir as _model_dir   # SGLang reads a directory holding config.json

SUPPORTED_VERSION = "0.5.23"
ENGINE = "sglang"
GIB = 2**30
log = logging.getLogger("kvatlas.integrations.sglang")

TARGET_POOLS = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._init_pools"
TARGET_PRICES = "sglang.srt.model_executor.pool_configurator.DSV4PoolConfigurator.calculate_pool_sizes"
TARGET_STATS = "sglang.srt.observability.metrics_collector.SchedulerMetricsCollector.log_stats"
STATE_PORT_ENV = "KVATLAS_SGLANG_STATE_PORT"

# pools the configurator sized from the budget (the index map and request table come on top)
PRICED_POOLS = frozenset({"swa_kv", "c4_kv", "c128_kv", "c4_indexer", "c4_state", "c4_indexer_state",
                          "c128_state"})


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    state_port: int | None = None   # /state JSON on a port of kvatlas's own; off unless set

    @classmethod
    def from_env(cls, env=None) -> "Settings":
        raw = (os.environ if env is None else env).get(STATE_PORT_ENV, "").strip()
        if not raw:
            return cls()
        if not raw.isdigit() or not 0 < int(raw) < 65536:
            log.warning("kvatlas: %s=%r is not a port (1-65535); /state stays off", STATE_PORT_ENV, raw)
            return cls()
        return cls(state_port=int(raw))


class _Process:
    """What the plugin holds in one process: the last pricing seen and the ledgers it reports."""

    def __init__(self) -> None:
        self.settings = Settings()
        self.pricing = None
        self.ledgers: list = []
        self.state_server = None


_P = _Process()


def sglang_version() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def register() -> bool:
    """The entry point. Returns whether the hooks were registered (SGLang ignores the value)."""
    try:
        version = sglang_version()
        if version != SUPPORTED_VERSION:
            log.warning("kvatlas: SGLang %s is not %s, the version this plugin knows; plugin off, "
                        "SGLang runs unchanged", version or "(not installed)", SUPPORTED_VERSION)
            return False
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
        _P.settings = Settings.from_env()
        HookRegistry.register(TARGET_PRICES, _on_priced, HookType.AFTER)
        HookRegistry.register(TARGET_POOLS, _on_pools_built, HookType.AFTER)
        HookRegistry.register(TARGET_STATS, _on_stats, HookType.AFTER)
        HookRegistry.register(sglang_prefix.TARGET_TREE, _guarded("noting the radix cache")(sglang_prefix.on_tree),
                              HookType.AFTER)
        return True
    except Exception as exc:  # a plugin must never stop the server
        log.warning("kvatlas: plugin not registered (%s: %s); SGLang runs unchanged", type(exc).__name__, exc)
        return False


def _guarded(what: str):
    """AFTER hooks return None (SGLang keeps its own result) and never raise into SGLang."""
    def wrap(fn):
        @functools.wraps(fn)
        def hook(*args, **kwargs):
            try:
                fn(*args, **kwargs)
            except Exception as exc:
                log.warning("kvatlas: %s failed (%s: %s); SGLang goes on unchanged", what, type(exc).__name__, exc)
            return None
        return hook
    return wrap


# ---- what the configurator priced ------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class Pricing:
    """The DSV4 configurator's budget and per-token prices (its own methods, read once)."""

    budget_bytes: int
    kv_bytes_per_entry: dict       # compress ratio (0 = SWA) -> page-padded bytes of one entry
    indexer_bytes_per_entry: float
    swa_ratio: float
    swa_cap_tokens: int | None     # cap mode: the SWA tokens it reserves; None: ratio mode
    c4_ring_rows: int
    c128_state_bytes: int
    page_tokens: int
    tails: "sglang_prefix.TailPricing | None" = None   # the SWA prefix-tail quota's figures

    def planned(self, pool: str, full_tokens: int, layers: int, row_bytes: int = 0) -> int:
        """Bytes the configurator charged for one pool, given the full tokens it settled on."""
        swa = self.swa_cap_tokens if self.swa_cap_tokens is not None else full_tokens * self.swa_ratio
        per_state_row = swa * self.c4_ring_rows / self.page_tokens * row_bytes
        price = {"swa_kv": swa * self.kv_bytes_per_entry[0], "c4_state": per_state_row,
                 "c4_indexer_state": per_state_row, "c4_kv": full_tokens / 4 * self.kv_bytes_per_entry[4],
                 "c4_indexer": full_tokens / 4 * self.indexer_bytes_per_entry,
                 "c128_kv": full_tokens / 128 * self.kv_bytes_per_entry[128]}
        if pool == "c128_state":
            return self.c128_state_bytes
        return round(price[pool] * layers) if pool in price else 0


@_guarded("reading the DSV4 configurator's prices")
def _on_priced(result, cfgr, available_bytes, *args, **kwargs) -> None:
    _P.pricing = pricing_of(cfgr, available_bytes)


def pricing_of(cfgr, budget_bytes: int) -> Pricing:
    requests = cfgr._resolve_max_running_requests_per_worker(budget_bytes)
    return Pricing(budget_bytes=int(budget_bytes),
                   kv_bytes_per_entry={r: cfgr._get_paged_kv_bytes_per_token(r) for r in (0, 4, 128)},
                   indexer_bytes_per_entry=float(cfgr.indexer_bytes_per_token), swa_ratio=float(cfgr.swa_ratio),
                   swa_cap_tokens=cfgr.swa_cap_tokens, c4_ring_rows=cfgr.ring_sizes.get(4, 0),
                   c128_state_bytes=int(cfgr._get_c128_state_fixed_bytes(requests)), page_tokens=cfgr.page_size,
                   tails=sglang_prefix.tail_pricing_of(cfgr))


# ---- at pool construction ----------------------------------------------------------------------

@_guarded("accounting the DeepSeek-V4 KV pools")
def _on_pools_built(result, kvc, *args, **kwargs) -> None:
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    if not isinstance(result.token_to_kv_pool, DeepSeekV4TokenToKVPool):
        return   # other models' pools set their own mem_usage
    pricing = None if kvc.is_draft_worker else _P.pricing
    track(result.req_to_token_pool, result.token_to_kv_pool, result.token_to_kv_pool_allocator, pricing)


def track(req_pool, kv, alloc, pricing: Pricing | None = None, *, publish: bool = True):
    """Audit one rank's pools, set `kv.mem_usage` to the truth, log the start-up line and (when
    SGLang's metrics are on) write the gauges. Returns the ledger. A pool already tracked in this
    process is not audited twice."""
    for ledger in _P.ledgers:
        if ledger.source is kv:
            return ledger
    ledger = build_ledger(req_pool, kv, alloc, pricing)
    kv.mem_usage = ledger.kv_cache_tensor_bytes / GIB   # SGLang's unit: GB = bytes / 2^30
    _P.ledgers.append(ledger)
    log.info(startup_line(ledger))
    if publish:
        _publish(ledger)
    return ledger


def build_ledger(req_pool, kv, alloc, pricing: Pricing | None):
    from ...cache.audit import audit
    from ..foreign import ForeignLedger
    roots = _roots(req_pool, kv, alloc)
    report = audit(roots)
    groups: dict[str, list] = {name: [] for name in roots}   # pools in the roots' order
    for e in report.entries:
        groups[_root_of(e.path)].append(e)
    page = alloc.page_size
    units_total = {"full_pages": alloc.size_full // page, "swa_pages": alloc.size_swa // page,
                   "request_slots": req_pool.available_size() + _used_slots(req_pool)}
    buffers = [_buffer(name, entries, kv, alloc, req_pool, pricing) for name, entries in groups.items() if entries]

    def used_units() -> dict:   # O(1): three counters SGLang keeps anyway
        return {"full_pages": (alloc.size_full - alloc.full_available_size()) // page,
                "swa_pages": (alloc.size_swa - alloc.swa_available_size()) // page,
                "request_slots": _used_slots(req_pool)}

    prefix = sglang_prefix.PrefixView(alloc, pricing.tails if pricing else None)
    ledger = ForeignLedger(engine=ENGINE, buffers=buffers, used_units=used_units, units_total=units_total,
                           labels=rank_labels(), budget_bytes=pricing.budget_bytes if pricing else None,
                           in_budget_pools=PRICED_POOLS, source=kv, audit_report=report,
                           evictable_units=prefix.evictable_units, extra=prefix.extra_samples)
    ledger.prefix = prefix   # the radix cache's view, read each stats interval
    return ledger


def _used_slots(req_pool) -> int:
    # slot 0 is padding; free_slots holds 1..size, so used = size - free
    return req_pool.size - req_pool.available_size()


def _roots(req_pool, kv, alloc) -> dict:
    """Named roots, walked breadth-first in this order: each storage is attributed to the first
    root that reaches it, and whatever the names miss is still counted under `other_*`."""
    roots = {"swa_kv": kv.swa_kv_pool}
    roots.update({f"c{r}_kv": p for r, p in kv.kv_pools.items() if p is not None})
    roots.update({f"c{r}_indexer": p for r, p in kv.index_pools.items() if p is not None})
    for name, pools in (("c4_state", kv.compress_state_pools), ("c128_state", kv.compress_state_pools),
                        ("c4_indexer_state", kv.indexer_compress_state_pools)):
        ratio = int(name[1:name.index("_")])
        roots[name] = [p for p in pools if p is not None and p.ratio == ratio]
    roots["full_to_swa_index"] = kv.full_to_swa_index_mapping
    roots["other_kv"] = kv
    roots["req_to_token"] = req_pool.req_to_token
    roots["other_request_table"] = req_pool
    roots["allocator"] = alloc
    return roots


_ROOT = re.compile(r"^\['([a-z0-9_]+)'\]")
_INDEX = re.compile(r"\[(\d+)\]")


def _root_of(path: str) -> str:
    m = _ROOT.match(path)
    return m.group(1) if m else "other_kv"


def layer_of(path: str, layers: tuple[int, ...]) -> int | None:
    """The model layer of one audited storage: lists under a root are in layer order."""
    m = _INDEX.search(path[path.index("]") + 1:]) if "]" in path else None
    return layers[int(m.group(1))] if m and layers and int(m.group(1)) < len(layers) else None


def _layers(kv, ratio: int | None) -> tuple[int, ...]:
    stage = range(kv.start_layer, kv.end_layer)
    if ratio is None:
        return tuple(stage)
    return tuple(i for i in stage if kv.compression_ratios[i] == ratio)


def _buffer(name: str, entries: list, kv, alloc, req_pool, pricing):
    """One pool in kvatlas's layout terms, with its real unit counts and reachability."""
    from ..foreign import ForeignBuffer
    tensor = sum(e.bytes for e in entries)
    first = entries[0]
    backing = sum(_backing_bytes(e) for e in entries)
    layout, space, per_unit = _layout(name, first, tensor, kv, alloc, req_pool)
    planned = 0
    if pricing is not None and name in PRICED_POOLS:
        row = first.bytes // first.shape[0] if name.endswith("state") else 0
        planned = pricing.planned(name, alloc.size_full, len(layout.spec.layers), row)
    return ForeignBuffer(layout=layout, tensor_bytes=tensor, reserved_bytes=backing, physical_bytes=backing,
                         planned_bytes=planned, index_space=space, bytes_per_used_unit=per_unit,
                         in_kv_cache=name not in ("req_to_token", "other_request_table", "allocator"),
                         storages=len(entries))


def _backing_bytes(entry) -> int:
    """CPU: the storage itself. CUDA: the caching allocator's block for it (512-B rounding);
    segment slack shared with other allocations is not attributed to the KV cache."""
    if entry.device.startswith("cuda"):
        from ...cache.arena import cuda_block_bytes
        return cuda_block_bytes(entry.bytes)
    return entry.bytes


def _layout(name: str, first, tensor_bytes: int, kv, alloc, req_pool):
    """(EngineBuffer, index space, bytes one used unit holds) for one named pool."""
    from ...engines.base import EngineBuffer, paged_buffer, row_buffer
    page = alloc.page_size
    full_pages, swa_pages = alloc.size_full // page, alloc.size_swa // page
    ratio = {"swa_kv": 0, "c4_kv": 4, "c128_kv": 128, "c4_indexer": 4}.get(name)
    if ratio is not None:
        sub = kv.swa_kv_pool if ratio == 0 else (kv.index_pools if "indexer" in name else kv.kv_pools)[ratio]
        layers = _layers(kv, None if ratio == 0 else ratio)
        units, reach = first.shape[0], swa_pages if ratio == 0 else full_pages
        space = "swa_pages" if ratio == 0 else "full_pages"
        spec = paged_buffer(name, pool=name, role="indexer" if "indexer" in name else "kv",
                            kind="swa" if ratio == 0 else f"c{ratio}", layers=layers,
                            fmt=_row_format(sub.get_bytes_per_token()), entries=sub.page_size, pages=units,
                            page_bytes=first.shape[1], group=space)
        return EngineBuffer(spec=spec, unreachable_units=units - 1 - reach), space, spec.unit_payload_bytes
    if name in ("c4_state", "c128_state", "c4_indexer_state"):
        ratio = 4 if name.startswith("c4") else 128
        ring = kv.get_ring_size(ratio)
        rows, row_bytes = first.shape[0], first.bytes // first.shape[0]
        # c4 rows follow SWA pages (page p: rows p*ring..), c128 rows request slots (slot 0 is padding)
        space, reach = ("swa_pages", swa_pages * ring) if ratio == 4 else ("request_slots", (kv.num_req_slots - 1) * ring)
        spec = row_buffer(name, pool=name, role="state", kind=f"c{ratio}", layers=_layers(kv, ratio), dtype=first.dtype,
                          row_bytes=row_bytes, rows=rows, null_rows=ring + 1, group=space)
        return (EngineBuffer(spec=spec, unreachable_units=rows - ring - 1 - reach), space,
                ring * row_bytes * len(spec.layers))
    if name == "full_to_swa_index":
        spec = row_buffer(name, pool=name, role="index_map", kind="all", layers=(), dtype=first.dtype,
                          row_bytes=first.bytes // first.shape[0], rows=first.shape[0], null_rows=0, group="full_pages")
        return EngineBuffer(spec=spec, in_budget=False), "full_pages", page * spec.unit_bytes
    if name == "req_to_token":
        row_bytes = first.bytes // first.shape[0]
        spec = row_buffer(name, pool=name, role="table", kind="all", layers=(), dtype=first.dtype, row_bytes=row_bytes,
                          rows=first.shape[0], null_rows=1, group="request_slots")
        return EngineBuffer(spec=spec, in_budget=False), "request_slots", row_bytes
    role = {"allocator": "free_list", "other_request_table": "table"}.get(name, "other")
    spec = row_buffer(name, pool=name, role=role, kind="all", layers=(), dtype="uint8",
                      row_bytes=tensor_bytes, rows=1, null_rows=0)
    return EngineBuffer(spec=spec, in_budget=False, note="storages kvatlas has no layout for"), None, 0


def _row_format(bytes_per_entry: int):
    from ...planning import formats
    known = (formats.FP8_DS_MLA, formats.indexer_format("fp8"), formats.indexer_format("fp4"))
    for fmt in known:
        if fmt.entry_bytes == bytes_per_entry:
            return fmt
    return formats.RowFormat(name=f"sglang_{bytes_per_entry}", data_bytes=bytes_per_entry)


def rank_labels() -> dict:
    """tp/pp/dp rank of this process as SGLang published them ("0" for no DP controller, as
    SGLang's own radix-cache metrics do; "unknown" where nothing was published)."""
    out = {}
    try:
        from sglang.srt.runtime_context import get_parallel
        par = get_parallel()
    except Exception:
        par = None
    for key in ("tp_rank", "pp_rank", "dp_rank"):
        try:
            value = getattr(par, key)
            out[key] = "0" if value is None else str(value)
        except Exception:
            out[key] = "unknown"
    return out


def startup_line(ledger) -> str:
    r = ledger.labels
    budget = ledger.budget_bytes
    over = "budget unknown" if budget is None else (
        f"pools sized from a {budget:,} B budget hold {budget + ledger.over_budget_bytes:,} B, "
        f"{ledger.over_budget_bytes:,} B over it")
    beside = sum(b.tensor_bytes for b in ledger.buffers if not b.in_kv_cache)
    return (f"kvatlas: DeepSeek-V4 KV cache tp{r['tp_rank']} pp{r['pp_rank']} dp{r['dp_rank']}: "
            f"{ledger.kv_cache_tensor_bytes:,} B in the KV pool (mem_usage {ledger.kv_cache_tensor_bytes / GIB:.6f} GB, "
            f"was 0); {over}; {ledger.unreachable_bytes:,} B unreachable by any index; "
            f"{beside:,} B beside it (request table, free lists)")


# ---- metrics and /state ----------------------------------------------------------------------

def _publish(ledger) -> None:
    if _multiprocess_metrics():
        from ..foreign import write_gauges
        write_gauges(ledger.snapshot())
    port = _P.settings.state_port
    if port is not None and _P.state_server is None:
        from ..foreign import serve_state
        rank = ledger.labels.get("tp_rank", "0")
        offset = int(rank) if rank.isdigit() else 0
        try:
            _P.state_server = serve_state(lambda: [lg.snapshot() for lg in _P.ledgers], port=port + offset)
            log.info("kvatlas: /state on %s", _P.state_server.url)
        except OSError as exc:
            log.warning("kvatlas: /state not served on port %d (%s)", port + offset, exc)


def _multiprocess_metrics() -> bool:
    """Only prometheus_client's multiprocess mode reaches SGLang's /metrics (the HTTP server
    aggregates the files the schedulers write); in-process gauges would be seen by nobody."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return False
    from prometheus_client import values
    return values.ValueClass.__name__ != "MutexValue"


@_guarded("refreshing the KV cache metrics")
def _on_stats(result, collector, *args, **kwargs) -> None:
    refresh()


def refresh() -> int:
    """Check each tracked ledger's prefix-tail quota (one warning line when hits are bounded by it)
    and write every snapshot into the gauges; returns the samples written."""
    for lg in _P.ledgers:
        lg.prefix.check(lg.labels)
    if not _P.ledgers or not _multiprocess_metrics():
        return 0
    from ..foreign import write_gauges
    return sum(write_gauges(lg.snapshot()) for lg in _P.ledgers)


def ledgers() -> list:
    """The ledgers tracked in this process (one per DeepSeek-V4 pool SGLang built here)."""
    return list(_P.ledgers)


# ---- building SGLang's pools offline, without a GPU (sizing a deployment) -------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class Offline:
    server_args: object
    configurator: object
    pools: object      # SGLang's own (req_to_token_pool, token_to_kv_pool, token_to_kv_pool_allocator)
    ledger: object


def build_offline(model, memory_bytes, *, max_running_requests: int = 256, chunked_prefill_tokens: int = 8192,
                  swa_mode: str = "ratio", context_length: int | None = None,
                  swa_ratio: float | None = None) -> Offline:
    """SGLang's own pools for `model` (a preset name, a config.json or a model directory) and a
    KV budget, built the way its scheduler builds them: its argument pipeline, its configurator
    (`config_from_budget`, the request count, the DSV4 sizes) and its `_init_pools`, on the CPU.
    `swa_mode="cap"` marks the SWA ratio as not given by the operator, the case SGLang's release
    comment describes (its V4 model override sets the ratio first, so a real launch is in ratio
    mode). `swa_ratio` passes `--swa-full-tokens-ratio` (ratio mode). Publishes SGLang's runtime
    context in this process, as its scheduler does. The
    pools' tensors come from `torch.empty` instead of `torch.zeros` while they are built, so a
    budget larger than this machine's memory is only reserved, never touched; sizes are unchanged.
    """
    import tempfile
    from ...errors import ConfigError
    from ...units import parse_bytes
    budget = parse_bytes(memory_bytes)
    if swa_mode not in ("ratio", "cap"):
        raise ConfigError("swa_mode", f"{swa_mode!r} is not an SGLang sizing mode", "use ratio or cap")
    if sglang_version() != SUPPORTED_VERSION:
        raise ConfigError("sglang", f"SGLang {sglang_version() or '(not installed)'} is not {SUPPORTED_VERSION}",
                          f"pip install --no-deps sglang=={SUPPORTED_VERSION} (see tests/sglang_plugin/setup_env.sh)")
    with tempfile.TemporaryDirectory(prefix="kvatlas-sglang-") as tmp:
        model_dir = _model_dir(model, tmp)
        argv = ["--model-path", model_dir, "--skip-tokenizer-init", "--device", "cpu", "--page-size", "256",
                "--max-running-requests", str(max_running_requests), "--chunked-prefill-size",
                str(chunked_prefill_tokens), "--kv-cache-dtype", "fp8_e4m3"]
        argv += ["--context-length", str(context_length)] if context_length else []
        argv += ["--swa-full-tokens-ratio", repr(swa_ratio)] if swa_ratio is not None else []
        from sglang.srt import runtime_context
        from sglang.srt.server_args import prepare_server_args
        args = prepare_server_args(argv)
        if swa_mode == "cap":
            args._swa_full_tokens_ratio_explicitly_set = False
        args.resolve_once()
        runtime_context.publish(args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=0))
        kvc = _configurator(args)
    return _size_and_build(args, kvc, budget)


def _configurator(args):
    """The KVCacheConfigurator, filled as ModelRunner.init_kv_cache_configurator fills it, for a
    target worker with no model loaded (the sizing path reads only the config)."""
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang.srt.mem_cache import kv_cache_dtype
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.model_runner_components.layer_setup import resolve_layer_indices
    from sglang.srt.model_executor.model_runner_components.load_model_utils import resolve_sliding_window_size
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config)
    from sglang.srt.runtime_context import get_model, get_parallel, get_schedule, get_spec
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    mc = ModelConfig.from_server_args(args)
    spec = SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm)
    dtype_str, kv_dtype = kv_cache_dtype.configure_kv_cache_dtype(
        server_args_kv_cache_dtype=get_model().kv_cache_dtype, model=None, model_dtype=mc.dtype,
        is_draft_worker=False, is_dflash=False, speculative_draft_attention_backend=None)
    return KVCacheConfigurator(
        device="cpu", gpu_id=0, attn_dp_size=get_parallel().attn_dp_size, pp_size=1, pp_group=None, model=None,
        model_config=mc, server_args=args, kv_cache_dtype=kv_dtype,
        kv_cache_dtype_str=dtype_str or get_model().kv_cache_dtype, model_dtype=mc.dtype,
        page_size=get_schedule().page_size, sliding_window_size=resolve_sliding_window_size(None, mc),
        spec_algorithm=spec, is_draft_worker=False, post_capture_kv_active=False,
        spec_aux_config=resolve_spec_aux_hidden_state_config(server_args=args, model_config=mc,
                                                             spec_algorithm=spec, is_draft_worker=False),
        is_hybrid_swa=mc.is_hybrid_swa, is_hybrid_swa_compress=mc.is_hybrid_swa_compress,
        use_mla_backend=mc.attention_arch == AttentionArch.MLA,
        layer_info=resolve_layer_indices(model=None, model_config=mc, is_draft_worker=False),
        forward_stream=None, req_to_token_pool=None, token_to_kv_pool_allocator=None, memory_pool_config=None)


def _size_and_build(args, kvc, budget: int) -> Offline:
    """The configurator's own sequence (KVCacheConfigurator.configure, with the budget given
    instead of profiled from a GPU)."""
    import torch
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    cfg = kvc.config_from_budget(budget)
    cfg.max_running_requests = kvc.resolve_max_num_reqs(cfg.max_total_num_tokens)
    cfg = create_memory_pool_configurator(kvc).finalize_with_max_running_requests(cfg)
    sizes = kvc._derive_pool_sizes(config=cfg)
    zeros = torch.zeros
    torch.zeros = torch.empty   # reserve, never touch: sizes and dtypes are the same
    try:
        pools = kvc._init_pools(sizes=sizes, req_to_token_pool=None, token_to_kv_pool_allocator=None)
    finally:
        torch.zeros = zeros
    pricing = pricing_of(create_memory_pool_configurator(kvc), budget)
    ledger = track(pools.req_to_token_pool, pools.token_to_kv_pool, pools.token_to_kv_pool_allocator, pricing)
    return Offline(server_args=args, configurator=kvc, pools=pools, ledger=ledger)
