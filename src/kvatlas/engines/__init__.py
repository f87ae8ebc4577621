"""Other engines' DeepSeek-V4 KV sizing, re-derived for comparison (pure Python, no torch).

A registry, not an if-ladder: each engine module exposes `ENGINE`, `OPTIONS` (its own knobs with
defaults) and `run(model, opts, budget, **engine_options) -> EngineResult`. A lineup entry is
"engine" or "engine:variant", a variant being a named set of engine options.
"""

from __future__ import annotations

import importlib
from dataclasses import fields

from ..errors import ConfigError
from ..planning.model import ModelSpec, load_model
from ..planning.options import ServeOptions
from .base import EngineBuffer, EngineResult, Reported

ENGINES = {"kvatlas": "kvatlas.engines.native", "sglang": "kvatlas.engines.sglang", "vllm": "kvatlas.engines.vllm"}
VARIANTS = {
    "kvatlas": {"default": {}},
    # default follows 0.5.23's code (ratio 0.1); cap is what its comment and SPEC §6 describe
    "sglang": {"default": {}, "ratio": {"swa_mode": "ratio"}, "cap": {"swa_mode": "cap"}},
    "vllm": {"default": {}, "sync": {"async_scheduling": False}},
}
DEFAULT_LINEUP = ("kvatlas", "sglang", "sglang:cap", "vllm")
_SERVE_FIELDS = frozenset(f.name for f in fields(ServeOptions))


def engine_module(name: str):
    if name not in ENGINES:
        raise ConfigError("engine", f"{name!r} is not a modelled engine", f"use one of {', '.join(ENGINES)}")
    return importlib.import_module(ENGINES[name])


def parse_entry(entry: str) -> tuple[str, dict]:
    """"sglang:cap" → ("sglang", {"swa_mode": "cap"}); "vllm@0.33:sync" → ("vllm", {"release": "0.33",
    "async_scheduling": False}). An engine without "@release" is its newest modelled release."""
    name, _, variant = entry.strip().partition(":")
    name, at, release = name.partition("@")
    mod = engine_module(name)
    variant = variant or "default"
    if variant not in VARIANTS[name]:
        raise ConfigError("engine", f"{name} has no variant {variant!r}",
                          f"use one of {', '.join(f'{name}:{v}' for v in VARIANTS[name])}")
    out = dict(VARIANTS[name][variant])
    if at:
        releases = getattr(mod, "RELEASES", ())
        if release not in releases:
            raise ConfigError("engine", f"{name}@{release}: {name} has no modelled release {release!r}",
                              f"use {' or '.join(f'{name}@{r}' for r in releases)}" if releases
                              else f"drop '@{release}' ({name} models one release)")
        out["release"] = release
    return name, out


def _resolve(model, options: dict) -> tuple[ModelSpec, ServeOptions, int, dict]:
    if isinstance(model, str):
        model = load_model(model)
    serve = {k: v for k, v in options.items() if k in _SERVE_FIELDS}
    engine_opts = {k: v for k, v in options.items() if k not in _SERVE_FIELDS}
    opts = ServeOptions.from_kwargs(**serve).resolve(model)
    return model, opts, opts.budget_bytes(), engine_opts


def run_engine(engine: str, model: ModelSpec | str, memory_bytes=None, **options) -> EngineResult:
    """One engine's allocation for a deployment. Serving options are kvatlas's (ServeOptions);
    any other keyword is an option of that engine and is refused by an engine that lacks it."""
    if memory_bytes is not None:
        options["memory_bytes"] = memory_bytes
    mod = engine_module(engine)
    model, opts, budget, engine_opts = _resolve(model, options)
    return mod.run(model, opts, budget, **engine_opts)


def compare(model: ModelSpec | str, memory_bytes=None, lineup=DEFAULT_LINEUP, engine_options: dict | None = None,
            on_result=None, **options) -> list[EngineResult]:
    """Every entry of `lineup` for the same deployment. `engine_options` maps an engine name to
    options added to each of its entries (after the variant's). `on_result(i, result)`, if
    given, is called as each entry is done (the CLI's progress bar)."""
    engine_options = engine_options or {}
    unknown = sorted(set(engine_options) - set(ENGINES))
    if unknown:
        raise ConfigError("engine", f"options given for {unknown[0]!r}, which is not a modelled engine",
                          f"use one of {', '.join(ENGINES)}")
    entries = [parse_entry(e) for e in lineup]
    idle = sorted(set(k for k, v in engine_options.items() if v) - {name for name, _ in entries})
    if idle:
        raise ConfigError("engine", f"{idle[0]} options were given but {idle[0]} is not in the lineup",
                          f"add {idle[0]} to the engines, or drop its options")
    if memory_bytes is not None:
        options["memory_bytes"] = memory_bytes
    model, opts, budget, extra = _resolve(model, options)
    if extra:
        raise ConfigError(sorted(extra)[0], "is not a serving option", "pass engine options through engine_options")
    results = []
    for name, variant in entries:
        results.append(engine_module(name).run(model, opts, budget, **{**variant, **engine_options.get(name, {})}))
        if on_result is not None:
            on_result(len(results), results[-1])
    return results


__all__ = ["DEFAULT_LINEUP", "ENGINES", "EngineBuffer", "EngineResult", "Reported", "VARIANTS", "compare",
           "engine_module", "parse_entry", "run_engine"]
