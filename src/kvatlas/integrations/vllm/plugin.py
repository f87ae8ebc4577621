"""vLLM plugin: a DeepSeek-V4 server reports its KV cache in bytes, per group and cache kind.

`pip install 'kvatlas[vllm]'` registers `register()` in the entry-point group
`vllm.general_plugins`; vLLM's `load_general_plugins()` calls it in every process it starts (API
server, engine core, workers). vLLM 0.33.x and 0.34.x are known: any other version gets one log
line and nothing else. Every hook catches its own errors: a failure logs one line and vLLM goes on
exactly as it would without the plugin.

The hooks (each wraps one vLLM method; the result is vLLM's own, returned unchanged):
- AFTER `EngineCore._initialize_kv_caches` (engine core): the KV budget the profiler measured
  (`available_gpu_memory_for_kv_cache`), for `over_budget` and the start-up line.
- AFTER `Executor.initialize_from_config` and `Executor.extend_kv_cache` (engine core, 0.34 with its
  extensible cache): the blocks of address space the workers reserve, and the blocks they commit
  after warm-up (and at any later extension): `reserved` vs `physical` bytes, one line per extension.
- AFTER `Executor.sleep`, `discard` and `wake_up` (engine core): while the "kv_cache" tag sleeps,
  the cache's physical bytes are 0 (its address range and views stay), and the board says so then.
- AFTER `Scheduler.__init__` (engine core; `AsyncScheduler` runs it too): the scheduler's
  `KVCacheConfig` and its `KVCacheManager`: the pool's layout per group and cache kind
  (`ledger`), a block census over its block pool (`census`), one start-up line
  with the tokens the pool truly holds beside vLLM's logged figure, and the first values.
- AFTER `Scheduler.make_stats` (engine core, every step that makes stats): a clock read; once per
  refresh interval (`KVATLAS_VLLM_REFRESH_S`, default 1 s; 0: every call) and when the scheduler
  goes idle, one count of the census from vLLM's own state (`census`: O(blocks), nothing on
  the allocation path is wrapped) written to this engine's board. A count that takes longer than
  1% of the interval (a big pool, a CPU shared with other work) pushes the next one out to 100×
  its own time, so the periodic reads take at most `MAX_CENSUS_SHARE` of the engine core's time.

How the values reach vLLM's /metrics: in 0.33 and 0.34 the engine core sends only `SchedulerStats` (one
usage float, prefix-cache counters) to the API server, whose /metrics serves
`get_prometheus_registry()`: the default registry with one API server, a multiprocess registry of
the API servers alone with several (`PROMETHEUS_MULTIPROC_DIR`, set only by
`run_multi_api_server`). So a gauge set in the engine core is seen by nobody. The plugin creates a
directory in the first process that loads it (the API server; `KVATLAS_VLLM_METRICS_DIR` names it
to the processes it starts), each engine core writes a board there (`boards.py`), and a collector
in the registry vLLM's /metrics serves exports every live board on each scrape.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass, replace

# a child of vLLM's logger: vLLM configures "vllm" (handler, format, level) and stops propagation
log = logging.getLogger("vllm.plugins.kvatlas")
METRICS_DIR_ENV = "KVATLAS_VLLM_METRICS_DIR"
REFRESH_ENV = "KVATLAS_VLLM_REFRESH_S"
DEFAULT_REFRESH_S = 1.0   # the board's freshness; Prometheus scrapes every 15 s by default
MAX_CENSUS_SHARE = 0.01   # the census's reads take at most this share of the engine core's time
ENGINE_CORE = "vllm.v1.engine.core.EngineCore"
SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
EXECUTOR = "vllm.v1.executor.abstract.Executor"
REGISTRY_FUNCS = ("vllm.v1.metrics.prometheus", "vllm.entrypoints.serve.instrumentator.metrics")


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    metrics_dir: str | None = None
    refresh_s: float = DEFAULT_REFRESH_S

    @classmethod
    def from_env(cls, env=None) -> "Settings":
        env = os.environ if env is None else env
        raw = env.get(REFRESH_ENV) or str(DEFAULT_REFRESH_S)
        try:
            refresh = float(raw)
        except ValueError:
            refresh = -1.0
        if not 0 <= refresh <= 3600:
            raise ValueError(f"{REFRESH_ENV}={raw!r}: give the seconds between census reads, 0 to 3600 "
                             f"(0: every stats call; default {DEFAULT_REFRESH_S:g})")
        return cls(metrics_dir=env.get(METRICS_DIR_ENV) or None, refresh_s=refresh)


class _Process:
    def __init__(self) -> None:
        self.registered = False
        self.metrics_dir: str | None = None
        self.refresh_s = DEFAULT_REFRESH_S
        self.budgets: dict[int, int] = {}                  # id(VllmConfig) -> bytes profiled
        self.reserved: dict[int, int] = {}                 # id(VllmConfig) -> blocks reserved (extensible)
        self.committed: dict[int, int] = {}                # id(VllmConfig) -> blocks of the latest extension
        self.trackers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # scheduler -> Tracker
        self.registries: set[int] = set()
        self.collector = None
        self.warned: set[str] = set()


_P = _Process()


def register() -> bool:
    """The entry point. Returns whether the hooks were installed (vLLM ignores the value)."""
    try:
        from . import offline
        version = offline.vllm_version()
        if not offline.supported(version):
            log.warning("kvatlas: vLLM %s is not %s, the versions this plugin knows; plugin off, vLLM runs "
                        "unchanged", version or "(not installed)", offline.supported_text())
            return False
        if _P.registered:
            return True
        settings = Settings.from_env()
        _P.refresh_s = settings.refresh_s
        _P.metrics_dir = _metrics_dir(settings)
        _after(ENGINE_CORE, "_initialize_kv_caches", _on_kv_caches)
        if offline.series(version) == "0.34":   # the extensible cache: where vLLM reserves and extends it
            _after(EXECUTOR, "initialize_from_config", _on_reserve)
            _after(EXECUTOR, "extend_kv_cache", _on_extend)
        for name in ("sleep", "discard", "wake_up"):   # the KV cache's memory released and restored
            _after(EXECUTOR, name, _on_residency)
        _after(SCHEDULER, "__init__", _on_scheduler)
        _after(SCHEDULER, "make_stats", _on_stats)
        _attach_collector()
        _P.registered = True
        return True
    except Exception as exc:   # a plugin must never stop the server
        log.warning("kvatlas: plugin not registered (%s: %s); vLLM runs unchanged", type(exc).__name__, exc)
        return False


def _metrics_dir(settings: Settings) -> str:
    """The boards' directory: inherited, or made here (the first process, which removes it at exit)."""
    if settings.metrics_dir:
        return settings.metrics_dir
    path = tempfile.mkdtemp(prefix="kvatlas-vllm-metrics-")
    os.environ[METRICS_DIR_ENV] = path   # the processes vLLM starts from here inherit it
    atexit.register(shutil.rmtree, path, True)
    return path


def _after(target: str, name: str, hook) -> None:
    """Wrap `target.name` so that `hook(self, result, *args)` runs after it; vLLM's result is returned
    unchanged and a failing hook logs one line per hook and nothing else."""
    import importlib
    module, cls_name = target.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), cls_name)
    original = cls.__dict__[name]
    if getattr(original, "__kvatlas_hook__", None) is hook:
        return

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        try:
            hook(self, result, *args, **kwargs)
        except Exception as exc:
            _warn_once(f"{cls_name}.{name}", f"kvatlas: {cls_name}.{name} hook failed ({type(exc).__name__}: {exc}); "
                                             "vLLM goes on unchanged")
        return result
    wrapper.__kvatlas_hook__ = hook
    setattr(cls, name, wrapper)


def _warn_once(key: str, message: str) -> None:
    if key not in _P.warned:
        _P.warned.add(key)
        log.warning(message)


# ---- the hooks ----------------------------------------------------------------------------------

def _on_kv_caches(core, kv_cache_config, vllm_config, *args, **kwargs) -> None:
    budget = core.available_gpu_memory_for_kv_cache
    if budget is not None and budget > 0:
        _P.budgets[id(vllm_config)] = int(budget)


def _on_reserve(executor, result, kv_cache_configs, *args, **kwargs) -> None:
    """0.34, extensible cache: the workers reserve address space for the planned blocks."""
    config = executor.vllm_config
    if getattr(config.cache_config, "enable_extensible_kv_cache", False) and kv_cache_configs:
        _P.reserved[id(config)] = kv_cache_configs[0].num_blocks


def _on_extend(executor, result, num_blocks, *args, **kwargs) -> None:
    """0.34, extensible cache: the workers committed `num_blocks` (after warm-up, or any later
    extension): every tracker of that engine follows, and says so in one line."""
    config = executor.vllm_config
    _P.committed[id(config)] = int(num_blocks)
    for scheduler, tracker in list(_P.trackers.items()):
        if scheduler.vllm_config is config and tracker.layout.extensible:
            tracker.extend(_P.reserved.get(id(config), tracker.layout.reserved_blocks), int(num_blocks))
            log.info(tracker.layout_line())


def _on_residency(executor, result, *args, **kwargs) -> None:
    """After the executor's sleep, discard or wake_up: while its "kv_cache" tag sleeps the cache's
    physical pages are gone (its addresses stay); the board says so at once (no steps run asleep)."""
    released = "kv_cache" in getattr(executor, "sleeping_tags", ())
    for scheduler, tracker in list(_P.trackers.items()):
        if scheduler.vllm_config is executor.vllm_config and tracker.layout.released != released:
            tracker.set_released(released)
            tracker.refresh()


def _on_scheduler(scheduler, result, *args, **kwargs) -> None:
    track(scheduler)


def _on_stats(scheduler, stats, *args, **kwargs) -> None:
    """Every step that makes stats: one clock read, and the census read at most once per refresh
    interval (longer where a read is slow: MAX_CENSUS_SHARE), or as the scheduler goes idle (so an
    idle server's board shows its last state)."""
    if stats is None:   # --disable-log-stats: no stats interval, nothing read
        return
    tracker = _P.trackers.get(scheduler)
    if tracker is None:
        return
    now = time.monotonic()
    busy = bool(scheduler.running) or bool(scheduler.waiting)
    if now >= tracker.due or (tracker.busy and not busy):
        tracker.due = now + _P.refresh_s
        tracker.refresh()
        if _P.refresh_s:   # a slow count (a big pool, a busy CPU) spaces the next one out in proportion
            tracker.due = max(tracker.due, now + (time.monotonic() - now) / MAX_CENSUS_SHARE)
    tracker.busy = busy


class Tracker:
    """One scheduler's layout, census, sample map and board."""

    def __init__(self, layout, census, board, sample_map) -> None:
        self.layout, self.census, self.board, self.sample_map = layout, census, board, sample_map
        self.last = None
        self.writes = 0
        self.due = 0.0          # monotonic time of the next refresh
        self.busy = False       # requests were running or waiting at the last stats call

    def extend(self, reserved_blocks: int, committed_blocks: int) -> None:
        """The cache was extended: reserved and physical bytes follow; the next read writes them."""
        from .ledger import SampleMap
        self.layout = self.layout.extended(reserved_blocks, committed_blocks)
        self.sample_map = SampleMap(self.layout)
        self.last = None
        self.due = 0.0

    def set_released(self, released: bool) -> None:
        """The KV cache's physical pages released (asleep) or restored: the next read writes the board."""
        from .ledger import SampleMap
        self.layout = replace(self.layout, released=released)
        self.sample_map = SampleMap(self.layout)
        self.last = None

    def layout_line(self) -> str:
        from .ledger import startup_line
        return startup_line(self.layout)

    def snapshot(self):
        """The full snapshot (pools, measures, occupancy), built from the census now."""
        from .ledger import snapshot
        return snapshot(self.layout, self.census.counts())

    def refresh(self) -> bool:
        """Read the census; when it moved, write this engine's board. Returns whether it wrote.
        O(blocks) for the count (`census`), O(groups × samples) for the values."""
        counts = self.census.counts()
        if counts == self.last:
            return False
        self.last = counts
        if self.board is not None:
            self.board.write(self.sample_map.values(counts))
        self.writes += 1
        return True


def track(scheduler, budget_bytes: int | None = None) -> Tracker | None:
    """Account one vLLM scheduler's KV cache (DeepSeek-V4 only); returns its tracker, or None for a
    model whose caches are not DeepSeek-V4's."""
    if scheduler in _P.trackers:
        return _P.trackers[scheduler]
    from .census import BlockCensus
    from .ledger import SampleMap, layout_of, startup_line
    config = scheduler.vllm_config
    model_type = getattr(config.model_config.hf_config, "model_type", "")
    if model_type != "deepseek_v4":   # V4 / V4-Pro only: V4.1's caches (bounded SWA replay) are not mapped
        log.info("kvatlas: model type %r is not DeepSeek-V4 (V4 / V4-Pro); its KV cache is not reported", model_type)
        return None
    budget = budget_bytes if budget_bytes is not None else _P.budgets.get(id(config))
    layout = layout_of(scheduler.kv_cache_config, config, budget)
    if id(config) in _P.reserved and id(config) in _P.committed:   # 0.34's extensible cache, extended
        layout = layout.extended(_P.reserved[id(config)], _P.committed[id(config)])
    coordinator = scheduler.kv_cache_manager.coordinator
    census = BlockCensus(coordinator.block_pool, coordinator.single_type_managers)
    sample_map = SampleMap(layout)
    board = None
    if _P.metrics_dir and os.path.isdir(_P.metrics_dir):
        from ..boards import Board
        board = Board(_P.metrics_dir, f"vllm-dp{layout.labels['dp_rank']}", sample_map.keys)
        weakref.finalize(scheduler, board.close)   # also at exit
    tracker = Tracker(layout, census, board, sample_map)
    _P.trackers[scheduler] = tracker
    log.info(startup_line(layout))
    tracker.refresh()
    return tracker


def trackers() -> list[Tracker]:
    return list(_P.trackers.values())


# ---- /metrics: the registry vLLM serves -----------------------------------------------------------

def _attach_collector() -> None:
    """Register the board collector in the default registry (what /metrics serves with one API
    server) and in every registry `get_prometheus_registry()` returns later (several API servers)."""
    import importlib
    import sys
    from ..boards import BoardCollector
    _P.collector = BoardCollector(_P.metrics_dir)
    if "prometheus_client" in sys.modules:
        from prometheus_client import REGISTRY
        _attach(REGISTRY)
    for name in REGISTRY_FUNCS:
        if name in sys.modules or name == REGISTRY_FUNCS[0]:
            module = importlib.import_module(name)
            module.get_prometheus_registry = _serving_registry(module.get_prometheus_registry)


def _serving_registry(original):
    if getattr(original, "__kvatlas_hook__", False):
        return original

    @functools.wraps(original)
    def get_prometheus_registry():
        registry = original()
        try:
            _attach(registry)
        except Exception as exc:
            _warn_once("registry", f"kvatlas: metrics not attached ({type(exc).__name__}: {exc})")
        return registry
    get_prometheus_registry.__kvatlas_hook__ = True
    return get_prometheus_registry


def _attach(registry) -> None:
    if id(registry) not in _P.registries:
        registry.register(_P.collector)
        _P.registries.add(id(registry))
