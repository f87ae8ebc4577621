"""kvatlas: the DeepSeek-V4 KV cache, planned, allocated and accounted to the byte."""

from __future__ import annotations

from .errors import BudgetError, ConfigError, KvatlasError, PoolExhaustedError, RequestStateError
from .planning import formats
from .planning.model import LayerKind, ModelSpec, load_model, preset_names
from .planning.options import ServeOptions
from .planning.planner import Plan, budget_for, max_concurrency, plan

__version__ = "0.1.0"


def audit(obj, **kwargs):
    """Every torch storage reachable from `obj`, each counted once, by attribute path.
    See kvatlas.cache.audit.audit (imported on first use: `kvatlas plan` never pays for it)."""
    from .cache.audit import audit as _audit
    from .checks import known_options
    known_options("audit", kwargs, ("max_objects", "max_depth", "root"))
    return _audit(obj, **kwargs)


def allocate(plan, device="cpu", backend="plain", **backend_options):
    """Allocate `plan` as real tensors (torch) and return the KVCache. Imports torch.
    backend="vmm" maps physical memory only under live data (CUDA + cuda-python); options:
    max_physical_bytes, keep_empty_chunks. backend="none" allocates nothing: allocator and ledger
    only, every buffer a meta tensor (any plan size; see kvatlas.cache.bookkeeping). With a prefix
    cache in the plan: prefix_policy (its resume points) and prefix_reuse_weight (its eviction's
    credit for pages read again, kvatlas.prefix.tree; 0: plain LRU)."""
    from .checks import require_torch
    require_torch("kvatlas.allocate")   # one line naming the fix, not a ModuleNotFoundError from deep inside
    from .cache.kvcache import allocate as _allocate
    return _allocate(plan, device=device, backend=backend, **backend_options)


# Modules of the public API that live in a story package but keep their short name; imported on
# first use, so `import kvatlas` stays as light as the plan path.
_LAZY_MODULES = {"server": ".observing.server", "datapath": ".datapath", "engines": ".engines"}
# Classes the README names at the top level, imported on first use for the same reason
_LAZY_NAMES = {"KvatlasCollector": ".observing.metrics"}


def __getattr__(name):
    import importlib
    if name in _LAZY_MODULES:
        module = importlib.import_module(_LAZY_MODULES[name], __name__)
        globals()[name] = module
        return module
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(_LAZY_NAMES[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BudgetError", "allocate", "audit", "formats", "ConfigError", "KvatlasCollector", "KvatlasError",
    "LayerKind", "ModelSpec", "Plan", "PoolExhaustedError",
    "RequestStateError", "ServeOptions", "budget_for", "load_model", "max_concurrency", "plan", "preset_names",
]
