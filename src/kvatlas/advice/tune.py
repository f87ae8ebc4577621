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
- max_model_len / context length: never below what the user allows: the `max_model_len` given (at
  least the workload's longest request, or refused), else the model's own; a workload is a sample
  of what will come, and a context cut to it refuses every longer request the user never ruled
  out. Every request of the workload must fit that context and the model's, or it is refused;
- max running requests is the workload's peak only as far as the budget holds that many slots
  beside one request of the context; the rest wait in the queue (said in `why`);
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
  with requests taken one after another), fewer where the plan cannot hold that many; vLLM's
  `--prefix-cache-retention-interval` takes the spacing kvatlas's policy fits to that many points.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..engines import sglang as sg
from ..engines import vllm as vl
from ..engines.base import EngineResult
from ..errors import BudgetError, ConfigError
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
    result: EngineResult | None = field(repr=False)   # None: the engine refuses to start this way

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

    def kvatlas_options(self, which: str = "tuned") -> dict:
        """plan()'s options that kvatlas's `which` ("default" or "tuned") flags set (the budget apart)."""
        names = {"--max-running-requests": "max_running_requests", "--chunked-prefill-tokens": "chunked_prefill_tokens",
                 "--max-model-len": "max_model_len", "--prefix-checkpoints": "prefix_checkpoints"}
        flags = getattr(self.engine("kvatlas"), which).flags
        return {names[k]: v for k, v in flags.items() if k in names}

    def kvatlas_plan(self, which: str = "tuned", checkpoints: int | None = None, running: int | None = None):
        """The plan kvatlas's `which` flags make, for this budget (with `checkpoints` resume points
        instead of theirs, if given; and `running` requests, each of the model's context, if given)."""
        opts = self.kvatlas_options(which)
        if checkpoints is not None:
            opts["prefix_checkpoints"] = checkpoints
        if running is not None:
            opts.update(max_running_requests=running, max_model_len=self.model.max_position_embeddings)
        return plan(self.model, self.budget_bytes, **opts)

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
    default = _or_refused(_sglang, model, base, budget, {}, ctxs, {"--swa-full-tokens-ratio": sg.DEFAULT_SWA_RATIO,
                          "--max-running-requests": base.max_running_requests,
                          "--chunked-prefill-size": base.chunked_prefill_tokens,
                          "--mem-fraction-static": "its own"})
    opts = replace(base, max_running_requests=t["running"], chunked_prefill_tokens=t["chunk"],
                   max_model_len=t["max_model_len"])
    with _tuned_refusal(sg.ENGINE, t, budget):
        need = sglang_swa_need(model, opts, budget, t["prompt_max"])
        ratio = sglang_ratio_for(model, opts, budget, need)
    flags = {"--swa-full-tokens-ratio": ratio, "--max-running-requests": t["running"],
             "--chunked-prefill-size": t["chunk"], "--mem-fraction-static": base.mem_fraction,
             "--context-length": t["max_model_len"]}
    with _tuned_refusal(sg.ENGINE, t, budget):
        tuned = _sglang(model, opts, budget, {"swa_ratio": ratio}, ctxs, flags)
    why = (f"--swa-full-tokens-ratio {ratio:g}: the smallest ratio whose SWA pool ({tuned.reported['swa_tokens']:,} "
           f"tokens) holds {need:,}: its cap-mode reserve for {t['running']} requests (their windows, two chunks, "
           f"four prefix tails each) and the longest prompt ({t['prompt_max']:,}), whose SWA a prefill holds whole "
           "with the radix cache on" + ("" if default.result is None else
                                        f"; the default 0.1 gives {default.reported['swa_tokens']:,} SWA tokens and "
                                        f"leaves {default.token_capacity:,} full tokens"),
           f"--max-running-requests {running_why(t, 'each request slot costs C128 state whether used or not')}",
           f"--mem-fraction-static {base.mem_fraction:g}: the share the budget was made from (weights + KV); SGLang "
           "picks its own default from the GPU and the parallelism, and both columns here use the same KV budget",
           f"--context-length {t['max_model_len']:,}: {_context_source(t)}",
           _difference(default, tuned, f"its SWA pool goes from {default.reported.get('swa_tokens', 0):,} to "
                       f"{tuned.reported['swa_tokens']:,} tokens and its request slots from "
                       f"{default.max_running_requests:,} to {tuned.max_running_requests:,}; what they held goes to "
                       "full-attention tokens"))
    return EngineAdvice(engine=sg.ENGINE, default=default, tuned=tuned, why=why)


def _difference(default: Setting, tuned: Setting, because: str) -> str:
    if default.result is None:
        return (f"default: it refuses to start with its defaults here ({default.reported['refused']}); the tuned "
                f"flags start it with {tuned.token_capacity:,} tokens")
    ratio = tuned.token_capacity / default.token_capacity if default.token_capacity else 0.0
    return (f"token capacity {ratio:.2f}× the default's ({default.token_capacity:,} → {tuned.token_capacity:,} "
            f"tokens): {because}")


def _vllm(model, opts: ServeOptions, budget: int, eng: dict, ctxs, flags: dict) -> Setting:
    r = vl.run(model, opts, budget, **eng)
    z = vl.configure(model, opts, vl.split_options(vl.ENGINE, vl.OPTIONS, eng), budget)
    return Setting(flags=flags, token_capacity=r.pool_tokens, max_running_requests=r.max_running_requests,
                   requests_at={c: vl.concurrency(z, c) for c in ctxs}, result=r,
                   reported={"num_gpu_blocks": z.num_blocks, "gpu_kv_cache_size_tokens": z.logged_tokens,
                             "max_concurrency": z.logged_concurrency})


def _or_refused(make, model, opts: ServeOptions, budget: int, eng: dict, ctxs, flags: dict) -> Setting:
    """The engine started with its defaults, or a row saying it refuses to start so (its
    figures 0): a budget its defaults do not fit is what tune is for."""
    try:
        return make(model, opts, budget, eng, ctxs, flags)
    except (BudgetError, ConfigError) as exc:
        reason = str(exc).split("; ")[0].split(": ", 1)[-1]
        return Setting(flags=flags, token_capacity=0, max_running_requests=opts.max_running_requests,
                       requests_at={c: 0 for c in ctxs}, result=None, reported={"refused": reason})


class _tuned_refusal:
    """An engine that will not start even with the tuned flags: refused in tune's own terms (the
    engine models' messages name flags tune does not take)."""

    def __init__(self, engine: str, t: dict, budget: int) -> None:
        self.engine, self.t, self.budget = engine, t, budget

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is not None and issubclass(kind, (BudgetError, ConfigError)):
            reason = str(exc).split("; ")[0].split(": ", 1)[-1]
            raise BudgetError(f"memory_bytes: {self.engine} does not start in {self.budget:,} B per rank even with "
                              f"{self.t['running']} running requests of up to {self.t['max_model_len']:,} tokens "
                              f"({reason}); raise memory_bytes, give a smaller max_model_len, or name only the "
                              f"other engines (engines={','.join(e for e in ENGINES if e != self.engine.split()[0])})") from None
        return False


def advise_vllm(model, base: ServeOptions, budget: int, t: dict, ctxs) -> EngineAdvice:
    batched, seqs = vl.batch_defaults(base.gpu, "serve")
    dopts = replace(base, max_running_requests=seqs)
    default = _or_refused(_vllm, model, dopts, budget, {}, ctxs, {"--max-num-seqs": seqs,
                          "--max-num-batched-tokens": batched, "--max-model-len": base.max_model_len,
                          "--prefix-cache-retention-interval": 0, "--gpu-memory-utilization": base.mem_fraction})
    opts = replace(base, max_running_requests=t["running"], max_model_len=t["max_model_len"])
    interval = t["spacing_pages"] * base.page_tokens
    flags = {"--max-num-seqs": t["running"], "--max-num-batched-tokens": t["chunk"],
             "--max-model-len": t["max_model_len"], "--prefix-cache-retention-interval": interval,
             "--gpu-memory-utilization": base.mem_fraction}
    with _tuned_refusal(vl.ENGINE, t, budget):
        tuned = _vllm(model, opts, budget, {"max_num_batched_tokens": t["chunk"]}, ctxs, flags)
    why = (f"--max-num-batched-tokens {t['chunk']:,}: the smallest batch whose pass overhead stays under a tenth of "
           "its prefill; every sliding group reserves blocks for two batches of it per request being admitted",
           f"--max-num-seqs {running_why(t, f'its default on {base.gpu} is {seqs:,}')}",
           f"--max-model-len {t['max_model_len']:,}: {_context_source(t)}; its 'GPU KV cache size' "
           f"then reads {tuned.reported['gpu_kv_cache_size_tokens']:,} tokens (a concurrency × max_model_len, "
           "not a capacity)",
           (f"--prefix-cache-retention-interval {interval:,}: a replay checkpoint every {t['spacing_pages']} pages, "
            "the spacing kvatlas's resume-point policy fits to the same budget") if interval else
           "--prefix-cache-retention-interval 0: the budget holds no resume point for kvatlas here either",
           _difference(default, tuned, f"{tuned.max_running_requests:,} sequences instead of "
                       f"{default.max_running_requests:,} and batches of {t['chunk']:,} instead of {batched:,} change "
                       "the sliding blocks it reserves per request admitted and per batch; the rest goes to "
                       "full-attention blocks")) + _vllm_sizing_why(tuned, base)
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
    try:
        p = plan(model, budget, **_plan_kwargs(opts))
    except BudgetError as exc:   # kvatlas's defaults on a budget too small for them: it refuses to start
        return Setting(flags=flags, token_capacity=0, max_running_requests=opts.max_running_requests,
                       requests_at={c: 0 for c in ctxs}, result=None,
                       reported={"refused": f"{opts.max_running_requests} running requests and one of "
                                 f"{opts.max_model_len:,} tokens do not fit in {budget:,} B ({str(exc).split(': ')[0]})"})
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
    fits = lambda k: _fits(model, budget, {**_plan_kwargs(opts), "prefix_checkpoints": k})
    if not fits(n):   # a small budget: the estimate ignores what running requests hold at the peak
        n = _largest(fits, 0, n)
    if n == 0:
        return 0, 0
    p = plan(model, budget, **{**_plan_kwargs(opts), "prefix_checkpoints": n})
    return n, fitted(POLICIES["kvatlas"], p.num_full_pages - 1, n).spacing_pages


def _fits(model, budget: int, kw: dict) -> bool:
    try:
        plan(model, budget, **kw)
    except BudgetError:
        return False
    return True


def _largest(fits, lo: int, hi: int) -> int:
    """The largest k in [lo, hi] with fits(k), fits being monotone (lo - 1 when none does)."""
    if not fits(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


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
    points = (f"--prefix-checkpoints {t['checkpoints']:,}: resume points worth a quarter of the budget (its prefix "
              "cache's calibration share), or as many as fit; its policy then "
              f"keeps one every {t['spacing_pages']} pages besides request ends and divergence points"
              if t["checkpoints"] else
              "--prefix-checkpoints 0: the budget holds no resume point beside the running requests (no prefix cache)")
    why = (points, f"--max-running-requests {running_why(t, 'a slot' + chr(39) + 's fixed state is reserved up front')}",
           f"--max-model-len {mml:,}: at least {_context_source(t)}, and enough that {t['running']} requests address "
           "every page the budget buys (kvatlas sizes no page no request can reach)",
           f"--memory {budget:,}: the GPU's share less the weights",
           kvatlas_difference(model, default, tuned, budget, opts, t))
    return EngineAdvice(engine="kvatlas", default=default, tuned=tuned, why=why)


def kvatlas_difference(model, default: Setting, tuned: Setting, budget: int, opts: ServeOptions, t: dict) -> str:
    """Why the tuned row's figures differ from the default's (capacity spent on resume points,
    fewer slots' fixed state)."""
    if default.result is None:
        return (f"default: kvatlas refuses to start with its defaults here ({default.reported['refused']}); "
                f"the tuned flags start it with {tuned.token_capacity:,} tokens")
    from ..planning.capacity import capacity
    cap = capacity(plan(model, budget, **_plan_kwargs(opts)))
    ratio = tuned.token_capacity / default.token_capacity if default.token_capacity else 0.0
    parts = []
    if cap.resume_points is not None:
        rp = cap.resume_points
        held = "" if rp.count == rp.kept else (f" ({rp.kept:,} kept, the rest saved per running request or crossed by "
                                                "a prefill chunk)")
        parts.append(f"{rp.count:,} resume points{held} take {rp.total_bytes:,} B, {rp.token_capacity_cost:,} tokens "
                     f"of capacity ({rp.tokens_without:,} without them)")
    reach = t["running"] * cdiv(opts.max_model_len, opts.page_tokens) * opts.page_tokens
    if reach < default.token_capacity:
        parts.append(f"{t['running']:,} requests of at most {opts.max_model_len:,} tokens address {reach:,} tokens "
                     "of pages, and kvatlas sizes no page no request can reach")
    if t["running"] != default.max_running_requests:
        parts.append(f"{t['running']:,} request slots instead of {default.max_running_requests:,} "
                     f"{'free' if t['running'] < default.max_running_requests else 'take'} their fixed state")
    return (f"token capacity {ratio:.2f}× the default's ({default.token_capacity:,} → {tuned.token_capacity:,} "
            "tokens): " + ("; ".join(parts) if parts else "the same pools") + "; what resume points cost buys "
            "prefix hits (kvatlas tune --simulate measures them)")


def running_why(t: dict, cost: str) -> str:
    if t["running"] < t["peak"]:
        return (f"{t['running']}: the most request slots the budget holds beside one request of "
                f"{t['max_model_len']:,} tokens; the workload's peak ({t['peak']:,} prefilling or decoding, +25%) "
                "is more, and the rest wait in the queue")
    return f"{t['running']}: the workload's peak of requests prefilling or decoding, +25%; {cost}"


def _context_source(t: dict) -> str:
    return {"user": f"the --max-model-len given ({t['max_model_len']:,})",
            "model": f"the model's context ({t['max_model_len']:,}: no --max-model-len given, and a workload's "
                     "longest request is no limit on the next one)"}[t["context_from"]]


ENGINES = ("sglang", "vllm", "kvatlas")


def tune(model: ModelSpec | str, prof: Profile, *, pace: Pace = Pace(), memory_bytes: int | None = None,
         engines=ENGINES, **options) -> Tuning:
    """Flags for every engine in `engines` (each once, in the order given); serving options as
    for plan() (gpu, mem_fraction, tp, weights_bytes — "auto" by default when memory_bytes is
    None; max_model_len: the context the user allows, default the model's). A workload with a
    request longer than that context is refused, naming the request and the limit."""
    from .profile import check_pace
    if isinstance(model, str):
        model = load_model(model)
    elif not isinstance(model, ModelSpec):
        raise ConfigError("model", f"{type(model).__name__} is not a model", "give a preset name, a config path or a ModelSpec")
    if not isinstance(prof, Profile):
        raise ConfigError("prof", f"{type(prof).__name__} is not a workload profile",
                          "give kvatlas.advice.profile(requests)")
    check_pace(pace, "pace")
    if isinstance(engines, str) or not hasattr(engines, "__iter__"):
        raise ConfigError("engines", f"{engines!r} is not a sequence of engine names", f"give e.g. {ENGINES}")
    engines = tuple(dict.fromkeys(engines))   # each once
    unknown = [e for e in engines if not isinstance(e, str) or e not in ENGINES]
    if not engines or unknown:
        raise ConfigError("engines", "names no engine" if not engines else f"{unknown[0]!r} has no tuning",
                          f"use some of {', '.join(ENGINES)}")
    if memory_bytes is None:
        options.setdefault("weights_bytes", "auto")
    base = ServeOptions.from_kwargs(memory_bytes=memory_bytes, **options).resolve(model)
    budget = base.budget_bytes()
    context = base.max_model_len   # the user's, or the model's
    if prof.context_max > context:
        limit = (f"the max_model_len given ({context:,})" if options.get("max_model_len") is not None
                 else f"{model.name}'s context ({context:,} tokens)")
        raise ConfigError("workload", f"its longest request has {prof.context_max:,} tokens (prompt + output), more "
                          f"than {limit}; no engine can run it",
                          "drop the requests longer than that" + (", or raise max_model_len" if
                                                                   context < model.max_position_embeddings else ""))
    peak = pick_running(prof)
    t = {"peak": peak, "chunk": pick_chunk(prof, pace), "prompt_max": prof.prompt_max, "max_model_len": context,
         "context_from": "user" if options.get("max_model_len") is not None else "model"}
    sized = replace(base, chunked_prefill_tokens=t["chunk"], max_model_len=context, prefix_checkpoints=0)
    fits = lambda n: _fits(model, budget, _plan_kwargs(replace(sized, max_running_requests=n)))
    t["running"] = peak if fits(peak) else _largest(fits, 1, peak)
    if t["running"] < 1:
        raise BudgetError(f"memory_bytes: {budget:,} B per rank cannot hold one request of {context:,} tokens "
                          "(max_model_len) beside the fixed pools; raise memory_bytes (or mem_fraction), or give a "
                          "smaller max_model_len")
    t["checkpoints"], t["spacing_pages"] = checkpoints_for(model, replace(sized, max_running_requests=t["running"]),
                                                           budget)
    ctxs = contexts_of(prof)
    advisers = {"sglang": advise_sglang, "vllm": advise_vllm, "kvatlas": advise_kvatlas}
    out = tuple(advisers[e](model, base, budget, t, ctxs) for e in engines)
    return Tuning(model=model, options=base, budget_bytes=budget, profile=prof, pace=pace, running=t["running"],
                  max_model_len=t["max_model_len"], chunk=t["chunk"], checkpoints=t["checkpoints"],
                  spacing_pages=t["spacing_pages"], engines=out)
