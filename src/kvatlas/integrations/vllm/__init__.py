"""kvatlas inside vLLM: its own planner and scheduler run offline, and the plugin that reports its KV cache.

Modules (each imports vLLM only when it is used; importing this package imports nothing of vLLM):
- `offline`: vLLM's own engine core, planner and scheduler for DeepSeek-V4 on a CPU, with an executor
  of ours where the GPU workers would stand (`build_engine`, `kv_cache_config`, `vllm_config`).
- `plugin`: the `vllm.general_plugins` entry point (`register`): hooks that report vLLM's KV cache
  in bytes per group and cache kind, returning vLLM's own results unchanged.
- `ledger`: vLLM's `KVCacheConfig` and block pool in kvatlas's measures (what the plugin reports).
- `census`: per-group held and evictable block counts, read from vLLM's block pool.
- `replica`: the offline engine with its KV events on (vLLM's own ZMQ publisher), the engine's own
  prefix hit, and one replica of the routing harness (`ReplicaServer`); kvatlas.routing's tests and
  benchmarks measure the router against it.

The offline engine's names are also reachable here (`kvatlas.integrations.vllm.build_engine`),
loaded on first use.
"""
from importlib import import_module

_OFFLINE = ("EngineOptions", "OfflineEngine", "build_engine", "kv_cache_config", "vllm_config",
            "vllm_version", "supported", "series", "BLOCK_TOKENS", "SUPPORTED_SERIES")


def __getattr__(name: str):
    if name in _OFFLINE:
        return getattr(import_module(".offline", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
