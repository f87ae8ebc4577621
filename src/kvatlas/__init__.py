"""kvatlas: the DeepSeek-V4 KV cache, planned, allocated and accounted to the byte."""

from __future__ import annotations

from .audit import audit as audit  # torch is imported inside audit(), not here
from .errors import BudgetError, ConfigError, KvatlasError, PoolExhaustedError, RequestStateError
from .model import LayerKind, ModelSpec, load_model, preset_names
from .options import ServeOptions
from .plan import Plan, budget_for, max_concurrency, plan

__version__ = "0.1.0"


def allocate(plan, device="cpu", backend="plain"):
    """Allocate `plan` as real tensors (torch) and return the KVCache. Imports torch."""
    from .cache.kvcache import allocate as _allocate
    return _allocate(plan, device=device, backend=backend)


__all__ = [
    "BudgetError", "allocate", "ConfigError", "KvatlasError", "LayerKind", "ModelSpec", "Plan", "PoolExhaustedError",
    "RequestStateError", "ServeOptions", "budget_for", "load_model", "max_concurrency", "plan", "preset_names",
]
