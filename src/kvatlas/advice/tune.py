"""`kvatlas tune`: the flags to start SGLang 0.5.23, vLLM 0.34 and kvatlas with, for a model, a
GPU, a parallelism and a workload, and what each engine then holds against its own defaults.

Every figure comes from the byte-exact engine models `compare` uses (`kvatlas.engines`) and from
`plan()`; the rules that pick a flag are small and stated in `why`:

- one KV budget per rank for every engine: the GPU's share (`mem_fraction`, SGLang's
  `--mem-fraction-static`, vLLM's `--gpu-memory-utilization`) less the weights from the config;
- max running requests / max_num_seqs: the most requests the workload keeps prefilling or
  decoding at once (`advice.profile`: a fluid model of continuous batching under the time model;
  requests waiting for the prefill stream wait in the queue, without a slot), a quarter more for
  bursts, rounded up to 8 — every slot an engine holds costs fixed state whether or not a request
  fills it;
- max_model_len / context length: the workload's longest request rounded up to a page;
- chunked prefill (SGLang's `--chunked-prefill-size`, vLLM's `--max-num-batched-tokens`): the
  smallest of 2K/4K/8K/16K whose pass's fixed cost is at most a tenth of its prefill compute under
  the time model (8K at the V4-Flash defaults), or the median prompt's size when that is smaller;
  vLLM reserves sliding blocks for two batches of it per request being admitted;
- SGLang's SWA pool: V4 runs its ratio mode (the model override sets the ratio); the smallest
  `--swa-full-tokens-ratio` whose SWA pool holds what its cap mode would reserve for those
  requests (the request cap, two chunks, four prefix tails of window + page per running request)
  plus the longest prompt whole: with the radix cache on, SGLang frees no out-of-window SWA while a
  request prefills (`ScheduleBatch.maybe_evict_swa` evicts in extend mode only without prefix
  sharing); the prefill's SWA only becomes evictable in the tree, newer than every other
  request's tail, so a pool smaller than the prompt evicts the tails other sessions resume from;
- resume points: kvatlas keeps `--prefix-checkpoints` worth a quarter of the budget (the share its
  prefix cache was calibrated with on the Mooncake trace: 90–97% of the hit ceiling at 64–120 GiB
  with requests taken one after another); vLLM's
  `--prefix-cache-retention-interval` takes the spacing kvatlas's policy fits to that many points.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..engines import sglang as sg
from ..engines import vllm as vl
from ..engines.base import EngineResult
from ..errors import ConfigError
from ..planning.buffers import CHECKPOINTS
from ..planning.model import ModelSpec, load_model
from ..planning.options import ServeOptions
from ..planning.planner import budget_for_mix, plan
from ..units import cdiv, round_up
from .profile import Pace, Profile

TUNE_SCHEMA = "kvatlas.tune"
TUNE_SCHEMA_VERSION = 1
CHUNKS = (2048, 4096, 8192, 16384)
BURST = 1.25
CHECKPOINT_SHARE = 1 / 4   # the prefix cache's calibration (bench/RESULTS.md, issue 12): 90-97% of the ceiling at 64-120 GiB


@dataclass(frozen=True, slots=True, kw_only=True)
class Setting:
    """One engine started one way: its flags and what its sizing then gives."""

    flags: dict                 # flag → value, as its command line spells them
    token_capacity: int         # tokens its pools hold (running requests and, beyond them, the prefix cache)
    max_running_requests: int
    requests_at: dict           # context tokens → requests of that length held at once
    reported: dict              # what the engine logs at start-up
    result: EngineResult = field(repr=False)

    def to_dict(self) -> dict:
        return {"flags": dict(self.flags), "token_capacity": self.token_capacity,
                "max_running_requests": self.max_running_requests,
                "requests_at": [{"context_tokens": c, "requests": n} for c, n in sorted(self.requests_at.items())],
                "reported": dict(self.reported)}


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineAdvice:
    engine: str
    default: Setting
    tuned: Setting
    why: tuple[str, ...]

    @property
    def capacity_ratio(self) -> float:
        return self.tuned.token_capacity / self.default.token_capacity if self.default.token_capacity else 0.0

    def command(self) -> str:
        return " ".join(f"{k} {v}" if v is not True else k for k, v in self.tuned.flags.items())

    def to_dict(self) -> dict:
        return {"engine": self.engine, "command": self.command(), "tuned": self.tuned.to_dict(),
                "default": self.default.to_dict(), "capacity_ratio": self.capacity_ratio, "why": list(self.why)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Tuning:
    model: ModelSpec
    options: ServeOptions      # the deployment (budget, GPU, tp), as resolved
    budget_bytes: int
    profile: Profile
    pace: Pace
    running: int
    max_model_len: int
    chunk: int
    checkpoints: int
    spacing_pages: int
    engines: tuple[EngineAdvice, ...]

    def engine(self, name: str) -> EngineAdvice:
        return next(e for e in self.engines if e.engine.split()[0] == name)

    def kvatlas_plan(self, which: str = "tuned"):
        """The plan kvatlas's `which` ("default" or "tuned") flags make, for this budget."""
        names = {"--max-running-requests": "max_running_requests", "--chunked-prefill-tokens": "chunked_prefill_tokens",
                 "--max-model-len": "max_model_len", "--prefix-checkpoints": "prefix_checkpoints"}
        flags = getattr(self.engine("kvatlas"), which).flags
        return plan(self.model, self.budget_bytes, **{names[k]: v for k, v in flags.items() if k in names})

    def to_dict(self) -> dict:
        o = self.options
        return {"schema": TUNE_SCHEMA, "schema_version": TUNE_SCHEMA_VERSION, "model": self.model.name,
                "gpu": o.gpu, "tp": o.tp, "mem_fraction": o.mem_fraction, "budget_bytes": self.budget_bytes,
                "weights_bytes": o.weights_bytes if o.memory_bytes is None else None,
                "workload": self.profile.to_dict(),
                "time_model": {"pass_s": self.pace.pass_s, "prefill_s_per_token": self.pace.prefill_s_per_token,
                               "decode_s_per_token": self.pace.decode_s_per_token},
                "engines": [e.to_dict() for e in self.engines]}


def pick_chunk(prof: Profile, pace: Pace) -> int:
    """The smallest chunk whose pass's fixed cost is at most a tenth of its prefill compute (so
    prefill throughput stays within 10% of its ceiling), and no larger than the median prompt
    needs when that is smaller."""
    for c in CHUNKS:
        if pace.pass_s <= 0.1 * c * pace.prefill_s_per_token or c >= prof.prompt_p50:
            return c
    return CHUNKS[-1]


def pick_running(prof: Profile) -> int:
    return max(8, round_up(int(prof.peak_in_flight * BURST + 0.999), 8))


def contexts_of(prof: Profile) -> tuple[int, ...]:
    return tuple(sorted({prof.context_p50, prof.context_p90, prof.context_max}))


# ---- each engine, one way -------------------------------------------------------------------

def _sglang(model, opts: ServeOptions, budget: int, eng: dict, ctxs, flags: dict) -> Setting:
    r = sg.run(model, opts, budget, **eng)
    e = sg.split_options(sg.ENGINE, sg.OPTIONS, eng)
    s = sg.setup_for(model, opts, e)
    z = sg.configure(model, s, budget)
    return Setting(flags=flags, token_capacity=r.pool_tokens, max_running_requests=r.max_running_requests,
                   requests_at={c: sg.concurrency(s, z, c) for c in ctxs}, result=r,
                   reported={"max_total_num_tokens": z.full_tokens, "swa_tokens": z.swa_tokens,
                             "swa_full_tokens_ratio": s.swa_ratio})


def sglang_swa_need(model, opts: ServeOptions, budget: int, longest_prompt: int) -> int:
    """SWA tokens SGLang's pool must hold so no prefix tail is evicted: its cap-mode reserve for
    these requests plus the longest prompt's SWA, held whole while it prefills (module doc)."""
    cap = sg.configure(model, sg.setup_for(model, opts, {**sg.OPTIONS, "swa_mode": "cap"}), budget).swa_cap_tokens
    return cap + round_up(longest_prompt, opts.page_tokens)


def sglang_ratio_for(model, opts: ServeOptions, budget: int, need: int) -> float:
    """The smallest ratio (to 1e-4) whose SWA pool holds `need` tokens."""
    lo, hi = 1, 10000          # in units of 1e-4
    swa = lambda k: sg.configure(model, sg.setup_for(model, opts, {**sg.OPTIONS, "swa_ratio": k / 1e4}), budget).swa_tokens
    if swa(hi) < need:
        raise ConfigError("memory", f"{sg.ENGINE}: no SWA ratio holds {need:,} SWA tokens in {budget:,} B",
                          "raise the budget or lower max running requests")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if swa(mid) >= need else (mid, hi)
    return (lo if swa(lo) >= need else hi) / 1e4


def advise_sglang(model, base: ServeOptions, budget: int, t: dict, ctxs) -> EngineAdvice:
    default = _sglang(model, base, budget, {}, ctxs, {"--swa-full-tokens-ratio": sg.DEFAULT_SWA_RATIO,
                      "--max-running-requests": base.max_running_requests,
                      "--chunked-prefill-size": base.chunked_prefill_tokens,
                      "--mem-fraction-static": "its own"})
    opts = replace(base, max_running_requests=t["running"], chunked_prefill_tokens=t["chunk"],
                   max_model_len=t["max_model_len"])
    need = sglang_swa_need(model, opts, budget, t["prompt_max"])
    ratio = sglang_ratio_for(model, opts, budget, need)
    flags = {"--swa-full-tokens-ratio": ratio, "--max-running-requests": t["running"],
             "--chunked-prefill-size": t["chunk"], "--mem-fraction-static": base.mem_fraction,
             "--context-length": t["max_model_len"]}
    tuned = _sglang(model, opts, budget, {"swa_ratio": ratio}, ctxs, flags)
    why = (f"--swa-full-tokens-ratio {ratio:g}: the smallest ratio whose SWA pool ({tuned.reported['swa_tokens']:,} "
           f"tokens) holds {need:,}: its cap-mode reserve for {t['running']} requests (their windows, two chunks, "
           f"four prefix tails each) and the longest prompt ({t['prompt_max']:,}), whose SWA a prefill holds whole "
           f"with the radix cache on; the default 0.1 gives {default.reported['swa_tokens']:,} SWA tokens and "
           f"leaves {default.token_capacity:,} full tokens",
           f"--max-running-requests {t['running']}: the workload's peak of requests prefilling or decoding, "
           "+25%; each request slot costs C128 state whether used or not",
           f"--mem-fraction-static {base.mem_fraction:g}: the share the budget was made from (weights + KV); SGLang "
           "picks its own default from the GPU and the parallelism, and both columns here use the same KV budget")
    return EngineAdvice(engine=sg.ENGINE, default=default, tuned=tuned, why=why)


def _vllm(model, opts: ServeOptions, budget: int, eng: dict, ctxs, flags: dict) -> Setting:
    r = vl.run(model, opts, budget, **eng)
    z = vl.configure(model, opts, vl.split_options(vl.ENGINE, vl.OPTIONS, eng), budget)
    return Setting(flags=flags, token_capacity=r.pool_tokens, max_running_requests=r.max_running_requests,
                   requests_at={c: vl.concurrency(z, c) for c in ctxs}, result=r,
                   reported={"num_gpu_blocks": z.num_blocks, "gpu_kv_cache_size_tokens": z.logged_tokens,
                             "max_concurrency": z.logged_concurrency})


def advise_vllm(model, base: ServeOptions, budget: int, t: dict, ctxs) -> EngineAdvice:
    batched, seqs = vl.batch_defaults(base.gpu, "serve")
    dopts = replace(base, max_running_requests=seqs)
    default = _vllm(model, dopts, budget, {}, ctxs, {"--max-num-seqs": seqs, "--max-num-batched-tokens": batched,
                    "--max-model-len": base.max_model_len, "--prefix-cache-retention-interval": 0,
                    "--gpu-memory-utilization": base.mem_fraction})
    opts = replace(base, max_running_requests=t["running"], max_model_len=t["max_model_len"])
    interval = t["spacing_pages"] * base.page_tokens
    flags = {"--max-num-seqs": t["running"], "--max-num-batched-tokens": t["chunk"],
             "--max-model-len": t["max_model_len"], "--prefix-cache-retention-interval": interval,
             "--gpu-memory-utilization": base.mem_fraction}
    tuned = _vllm(model, opts, budget, {"max_num_batched_tokens": t["chunk"]}, ctxs, flags)
    why = (f"--max-num-batched-tokens {t['chunk']:,}: the smallest batch whose pass overhead stays under a tenth of "
           "its prefill; every sliding group reserves blocks for two batches of it per request being admitted",
           f"--max-num-seqs {t['running']}: the workload's peak of requests prefilling or decoding, +25% (its "
           f"default on {base.gpu}: {seqs:,})",
           f"--max-model-len {t['max_model_len']:,}: the longest request, page-rounded; its 'GPU KV cache size' "
           f"then reads {tuned.reported['gpu_kv_cache_size_tokens']:,} tokens (a concurrency × max_model_len, "
           "not a capacity)",
           f"--prefix-cache-retention-interval {interval:,}: a replay checkpoint every {t['spacing_pages']} pages, "
           "the spacing kvatlas's resume-point policy fits to the same budget") + _vllm_sizing_why(tuned, base)
    return EngineAdvice(engine=vl.ENGINE, default=default, tuned=tuned, why=why)


def _vllm_sizing_why(s: Setting, base: ServeOptions) -> tuple[str, ...]:
    """vLLM 0.34 sizes its cache after warm-up (the extensible cache): say what its default would
    take and why the flag holds it to the budget (engines.vllm.sizing_modes)."""
    m = s.result.figures.get("sizing")
    if not m:
        return ()
    e, f = m["extensible"], m["fixed"]
    return (f"--gpu-memory-utilization {base.mem_fraction:g} (vLLM 0.34): it sizes the KV cache after warm-up; left "
            f"unset (1.0 with its extensible cache) it would take {e['kv_bytes']:,} B ({e['num_blocks']:,} blocks), "
            f"with --no-enable-extensible-kv-cache (0.92) {f['kv_bytes']:,} B; {base.mem_fraction:g} holds it to the "
            "budget every column here uses",)


def _kvatlas(model, opts: ServeOptions, budget: int, ctxs, flags: dict) -> Setting:
    from ..engines.native import from_plan
    p = plan(model, budget, **_plan_kwargs(opts))
    r = from_plan(p)
    return Setting(flags=flags, token_capacity=p.max_total_tokens, max_running_requests=p.max_running_requests,
                   requests_at={c: p.concurrency_in_plan(c) for c in ctxs}, result=r,
                   reported={"max_total_tokens": p.max_total_tokens, "total_bytes": p.total_bytes,
                             "prefix_checkpoints": opts.prefix_checkpoints})


def _plan_kwargs(opts: ServeOptions) -> dict:
    keep = ("gpu", "page_tokens", "swa_page_tokens", "kv_layout", "indexer", "state_dtype",   # (a budget is given)
            "online_c128", "max_running_requests", "draft_tokens", "chunked_prefill_tokens", "draft_layers",
            "max_model_len", "tp", "pp", "dp", "pp_rank", "prefix_checkpoints")
    return {k: getattr(opts, k) for k in keep}


def checkpoints_for(model, opts: ServeOptions, budget: int) -> tuple[int, int]:
    """(resume points worth CHECKPOINT_SHARE of the budget, the spacing kvatlas's policy fits to them).
    A point's cost is what it takes from full pages: its state rows and its SWA tail's pages."""
    from ..prefix.policy import POLICIES, fitted
    probe = 1024
    opts = replace(opts, max_model_len=model.max_position_embeddings)   # every page the budget buys addressable
    kw = _plan_kwargs(opts)
    kw.pop("max_running_requests")
    a, b = (budget_for_mix(model, [(opts.max_running_requests, opts.page_tokens)], **{**kw, "prefix_checkpoints": k})
            for k in (1, 1 + probe))
    per_point = (b.total_bytes - a.total_bytes) / probe
    n = max(1, int(budget * CHECKPOINT_SHARE / per_point))
    p = plan(model, budget, **{**_plan_kwargs(opts), "prefix_checkpoints": n})
    return n, fitted(POLICIES["kvatlas"], p.num_full_pages - 1, n).spacing_pages


def advise_kvatlas(model, base: ServeOptions, budget: int, t: dict, ctxs) -> EngineAdvice:
    default = _kvatlas(model, base, budget, ctxs, {"--max-running-requests": base.max_running_requests,
                       "--chunked-prefill-tokens": base.chunked_prefill_tokens, "--max-model-len": base.max_model_len,
                       "--prefix-checkpoints": 0})
    opts = replace(base, max_running_requests=t["running"], chunked_prefill_tokens=t["chunk"],
                   max_model_len=t["max_model_len"], prefix_checkpoints=t["checkpoints"])
    # kvatlas sizes no more full pages than its requests can address: keep max_model_len high
    # enough that the budget's pages stay addressable (the surplus serves the prefix cache)
    fit = plan(model, budget, **{**_plan_kwargs(opts), "max_model_len": model.max_position_embeddings})
    mml = min(max(t["max_model_len"], cdiv(fit.num_full_pages - 1, t["running"]) * base.page_tokens),
              model.max_position_embeddings)
    opts = replace(opts, max_model_len=mml)
    flags = {"--max-running-requests": t["running"], "--chunked-prefill-tokens": t["chunk"],
             "--max-model-len": mml, "--prefix-checkpoints": t["checkpoints"], "--memory": f"{budget}"}
    tuned = _kvatlas(model, opts, budget, ctxs, flags)
    why = (f"--prefix-checkpoints {t['checkpoints']:,}: resume points worth a quarter of the budget (its prefix "
           "cache's calibration share); its policy then "
           f"keeps one every {t['spacing_pages']} pages besides request ends and divergence points",
           f"--max-running-requests {t['running']}: the workload's peak of requests prefilling or decoding, "
           "+25%; a slot's fixed state is reserved up front",
           f"--max-model-len {mml:,}: at least the longest request, and enough that {t['running']} requests address "
           "every page the budget buys (kvatlas sizes no page no request can reach)",
           f"--memory {budget:,}: the GPU's share less the weights")
    return EngineAdvice(engine="kvatlas", default=default, tuned=tuned, why=why)


def tune(model: ModelSpec | str, prof: Profile, *, pace: Pace = Pace(), memory_bytes: int | None = None,
         engines=("sglang", "vllm", "kvatlas"), **options) -> Tuning:
    """Flags for every engine in `engines`; serving options as for plan() (gpu, mem_fraction, tp,
    weights_bytes — "auto" by default when memory_bytes is None)."""
    if isinstance(model, str):
        model = load_model(model)
    if memory_bytes is None:
        options.setdefault("weights_bytes", "auto")
    base = ServeOptions.from_kwargs(memory_bytes=memory_bytes, **options).resolve(model)
    budget = base.budget_bytes()
    t = {"running": pick_running(prof), "chunk": pick_chunk(prof, pace), "prompt_max": prof.prompt_max,
         "max_model_len": min(round_up(prof.context_max, base.page_tokens), model.max_position_embeddings)}
    sized = replace(base, max_running_requests=t["running"], chunked_prefill_tokens=t["chunk"],
                    max_model_len=t["max_model_len"])
    t["checkpoints"], t["spacing_pages"] = checkpoints_for(model, sized, budget)
    ctxs = contexts_of(prof)
    advisers = {"sglang": advise_sglang, "vllm": advise_vllm, "kvatlas": advise_kvatlas}
    unknown = sorted(set(engines) - set(advisers))
    if unknown:
        raise ConfigError("engines", f"{unknown[0]!r} has no tuning", f"use some of {', '.join(advisers)}")
    out = tuple(advisers[e](model, base, budget, t, ctxs) for e in engines)
    return Tuning(model=model, options=base, budget_bytes=budget, profile=prof, pace=pace, running=t["running"],
                  max_model_len=t["max_model_len"], chunk=t["chunk"], checkpoints=t["checkpoints"],
                  spacing_pages=t["spacing_pages"], engines=out)
