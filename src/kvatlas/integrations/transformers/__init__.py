"""transformers' DeepSeek-V4 (`DeepseekV4ForCausalLM`) generating through a kvatlas KVCache.

    from kvatlas.integrations.transformers import kvatlas_cache_for
    out = model.generate(ids, past_key_values=kvatlas_cache_for(model, "1GiB"), max_new_tokens=32)

The cache is planned from the model's own config (`kvatlas.load_model(model.config)`): sliding
windows in SWA pages, compressed C4 / C128 entries and indexer keys in their paged pools,
compressor buffers and overlap in the state rings. `layout="exact"` keeps the model's rows bit for
bit (logits equal the model's own cache's); "fp8" (the default) stores what engines store.
`Server` (kvatlas.integrations.transformers.serve) serves many requests from one cache, with the
prefix cache and the host tier. Needs `pip install 'kvatlas[transformers]'`.
"""

from __future__ import annotations

from ...cache.kvcache import allocate
from ...errors import ConfigError
from ...planning.planner import plan
from .cache import KvatlasCache
from .model import LAYOUTS, as_checkpoint_loads, check_model, layout_options, model_spec


def plan_for(model, memory, *, layout: str = "fp8", **options):
    """A kvatlas Plan for `model` (its config gives the layers; `layout` the row formats, see
    kvatlas.integrations.transformers.model). `options` are kvatlas plan options
    (max_running_requests, max_model_len, chunked_prefill_tokens, prefix_checkpoints, ...); a
    kv_layout / indexer / state_dtype given there overrides the layout's."""
    spec = model_spec(check_model(model).config)
    if memory is None:
        raise ConfigError("memory", "None is not a KV budget", "give the cache's bytes, e.g. '1GiB' or 2**30")
    return plan(spec, memory, **{**layout_options(model, layout), **options})


def kvatlas_cache_for(model, memory, *, layout: str = "fp8", device=None, validate: bool = False,
                      group_read_bytes: int = 64 << 20, **options) -> KvatlasCache:
    """A KvatlasCache on the model's device (or `device`), planned by `plan_for`."""
    p = plan_for(model, memory, layout=layout, **options)
    kv = allocate(p, device=device if device is not None else model.device)
    return KvatlasCache(kv, model, validate=validate, group_read_bytes=group_read_bytes)


__all__ = ["KvatlasCache", "LAYOUTS", "as_checkpoint_loads", "kvatlas_cache_for", "layout_options", "model_spec",
           "plan_for"]
