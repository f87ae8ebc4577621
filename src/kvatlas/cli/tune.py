"""`kvatlas tune`: the flags to start SGLang 0.5.23, vLLM 0.33 and kvatlas with for a workload,
and what each setting holds against the engine's defaults (kvatlas.advice). With --simulate, the
workload also runs through kvatlas's own cache under its default and its tuned flags (the
bookkeeping backend: no pool memory) for the prefix-hit ratio and the queueing."""

from __future__ import annotations

import json

from ..observing.table import render
from ..units import fmt_bytes, parse_bytes
from .common import add_fit_running_args, check_fit_running_args, count, number, weights_arg
from .drive import add_time_model_args, add_workload_args, requests_from_args, time_model

ENGINES = ("sglang", "vllm", "kvatlas")


def add_parser(p) -> None:
    p.add_argument("model", nargs="?", default="deepseek-v4-flash",
                   help="preset name, config.json or model directory (default: deepseek-v4-flash)")
    g = p.add_argument_group("deployment")
    g.add_argument("--gpu", default="h200", help="h200 (default), h100, h20 or b200")
    g.add_argument("--tp", type=count(1), default=1, help="tensor parallelism: the weights split over it")
    g.add_argument("--pp", type=count(1), default=1, help="pipeline stages: the weights and layers split over them "
                   "(the first stage is advised; default 1)")
    g.add_argument("--mem-fraction", type=number(0.0, 1.0, open_low=True),
                   help="share of the GPU for weights + KV: SGLang's --mem-fraction-static, vLLM's "
                        "--gpu-memory-utilization (default 0.9); not with --memory")
    g.add_argument("--weights", help="the weights' share of one rank, or auto (default: from the config); "
                   "not with --memory")
    g.add_argument("--memory", help="the KV budget per rank instead (then the weights are not asked)")
    g.add_argument("--max-model-len", type=count(1), help="the longest request the deployment must take (default: "
                   "the model's context; the advice never sets a context below it, and refuses a workload with a "
                   "longer request)")
    g.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)} (default all)")
    add_workload_args(p)
    add_time_model_args(p)
    p.add_argument("--simulate", action="store_true", help="also run the workload through kvatlas's cache with its "
                   "default and its tuned flags: prefix-hit ratio and queueing (bookkeeping backend, no memory)")
    p.add_argument("--fit-checkpoints", action="store_true", help="replay the workload with kvatlas's tuned flags "
                   "at several shares of the budget in resume points and advise the count that hit most instead of "
                   "a quarter (bookkeeping backend; kvatlas simulate --prefix-checkpoints fit does the same)")
    add_fit_running_args(p, "--fit-checkpoints")
    p.add_argument("--json", action="store_true", help="print the advice as JSON (schema kvatlas.tune v1)")


def run(args) -> int:
    from ..advice import Pace, profile, tune
    from ..errors import ConfigError
    engines = tuple(dict.fromkeys(e.strip() for e in args.engines.split(",") if e.strip()))   # each once
    bad = [e for e in engines if e not in ENGINES]
    if not engines or bad:
        raise ConfigError("--engines", f"{args.engines!r} names {'no engine' if not engines else bad[0]!r}",
                          f"give a comma list of {', '.join(ENGINES)}")
    for flag, on in (("--simulate", args.simulate), ("--fit-checkpoints", args.fit_checkpoints)):
        if on and "kvatlas" not in engines:
            raise ConfigError(flag, "runs kvatlas's cache, and kvatlas is not in --engines", "add kvatlas")
    slack = check_fit_running_args(args, args.fit_checkpoints, "--fit-checkpoints")
    tm = time_model(args)
    pace = Pace(pass_s=tm.pass_s, prefill_s_per_token=tm.prefill_s_per_token, decode_s_per_token=tm.decode_s_per_token)
    from ..planning.model import load_model
    model = load_model(args.model)
    requests = requests_from_args(args)
    check_runnable(args, model, requests)
    prof = profile(requests, pace)
    memory = parse_bytes(args.memory, "--memory") if args.memory is not None else None
    kw = dict(pace=pace, memory_bytes=memory, engines=engines, gpu=args.gpu, tp=args.tp, pp=args.pp)
    if args.weights is not None:   # typed: beside --memory it is refused, never ignored; 0 as plan takes it
        kw["weights_bytes"] = weights_arg(args.weights)
    if args.mem_fraction is not None:
        kw["mem_fraction"] = args.mem_fraction
    if args.max_model_len is not None:
        kw["max_model_len"] = args.max_model_len
    t = tune(model, prof, **kw)
    simulated = fitted = None
    if args.simulate and t.engine("kvatlas").default.result is None:
        raise ConfigError("--simulate", "kvatlas refuses to start with its default flags on this budget, so "
                          "there is no default run to measure", "raise --memory, or drop --simulate")
    if args.fit_checkpoints:
        fitted = fit_tuned(t, requests, tm, args.fit_running, slack)
    if args.simulate:
        simulated = {w: run_setting(t, w, requests, tm) for w in ("default", "tuned")}
        if fitted is not None:
            simulated["fitted"] = run_setting(t, "tuned", requests, tm, fitted.best.checkpoints,
                                              fitted.best.running if fitted.running_fitted else None)
    if args.json:
        doc = t.to_dict()
        doc["simulated"] = simulated
        doc["fitted_checkpoints"] = None if fitted is None else fitted.to_dict()
        print(json.dumps(doc, indent=2))
    else:
        assumed = None if not workload_assumed(args) else "user" if args.max_model_len is not None else "model"
        print(text_report(t, simulated, assumed=assumed, fitted=fitted))
    return 0


def fit_tuned(t, requests, tm, running, slack: float):
    """kvatlas's resume points fitted to the workload with its other tuned flags (driving.fit);
    `running` (None: the tuned count): candidate running counts fitted too, each replayed with the
    model's context as --max-model-len (the tuned one is sized so the tuned count addresses every
    page), the count chosen within `slack` of the lowest mean TTFT."""
    from ..driving.fit import default_jobs, fit_checkpoints
    opts = {**t.kvatlas_options("tuned"), "prefix_checkpoints": 0, "memory_bytes": t.budget_bytes}
    if running:
        del opts["max_running_requests"]
        opts["max_model_len"] = t.model.max_position_embeddings
    return fit_checkpoints(t.model, requests, simulator={"time_model": tm}, jobs=default_jobs(), running=running,
                           ttft_slack=slack, **opts)


# the flags that describe a workload: with none of them given, tune assumes its built-in one
WORKLOAD_FLAGS = ("--workload", "--rate", "--duration", "--prompt-len", "--output-len", "--turns", "--followup-len",
                  "--think", "--system-prompts", "--system-prompt-len", "--seed")


def workload_assumed(args) -> bool:
    given = getattr(args, "argv", None) or []
    return not any(a == f or a.startswith(f + "=") for a in given for f in WORKLOAD_FLAGS)


def check_runnable(args, model, requests) -> None:
    """Refuse, naming the request and the limit, a workload no deployment of the model can run
    (or none within --max-model-len)."""
    from ..errors import ConfigError
    longest = max(requests, key=lambda r: r.prompt_tokens + r.output_tokens)
    n = longest.prompt_tokens + longest.output_tokens
    limit = args.max_model_len or model.max_position_embeddings
    if n <= limit:
        return
    what = (f"--max-model-len {limit:,}" if args.max_model_len else
            f"{model.name}'s context of {limit:,} tokens (max_position_embeddings)")
    if args.workload == "synthetic":
        flag = "--prompt-len" if longest.prompt_tokens > limit else "--output-len"
        raise ConfigError(flag, f"makes a request of {longest.prompt_tokens:,} prompt + {longest.output_tokens:,} "
                          f"output = {n:,} tokens, more than {what}", "give lengths whose sum fits it")
    raise ConfigError("--workload", f"request {longest.id!r} has {longest.prompt_tokens:,} prompt + "
                      f"{longest.output_tokens:,} output = {n:,} tokens, more than {what}",
                      "drop the requests longer than that" + ("" if args.max_model_len is None
                                                               else ", or raise --max-model-len"))


def run_setting(t, which: str, requests, tm, checkpoints: int | None = None, running: int | None = None) -> dict:
    """The workload through kvatlas's cache planned with its `which` ("default"/"tuned") flags
    (and `checkpoints` resume points, `running` requests instead of theirs, if given)."""
    from ..driving.measure import measure
    return measure(t.kvatlas_plan(which, checkpoints, running), requests, tm).to_dict()


def _ctx(c: int) -> str:
    return f"{c:,}"


def text_report(t, simulated=None, assumed: str | None = None, fitted=None) -> str:
    """`assumed`: None when a workload was given; else where the context came from ("user", "model");
    `fitted`: kvatlas's resume points fitted by replay (driving.fit.Fit), if asked."""
    o, prof = t.options, t.profile
    head = (f"kvatlas tune — {t.model.name} on {o.gpu}, tp={o.tp}, KV budget {t.budget_bytes:,} B "
            f"({fmt_bytes(t.budget_bytes)}) per rank"
            + (f" = {o.gpu} × {o.mem_fraction:g} less weights {fmt_bytes(o.weights_bytes)}" if o.memory_bytes is None else "")
            + f"\nworkload: {prof.requests:,} requests over {prof.span_s:,.0f} s; context p50 {prof.context_p50:,}, "
              f"p90 {prof.context_p90:,}, max {prof.context_max:,} tokens; {prof.peak_in_flight:,} running at the peak, "
              f"{prof.mean_in_flight:.1f} on average (prefilling or decoding; a fluid model under the time model)")
    if assumed:
        head += ("\nassumed: no workload given (--workload, --rate, --prompt-len, …), so the built-in synthetic one "
                 "above; the running-request and chunk flags fit it, the context length is "
                 + (f"the --max-model-len given ({t.max_model_len:,})" if assumed == "user" else
                    f"the model's ({t.max_model_len:,}; give --max-model-len to cap it)")
                 + "; give --workload TRACE to tune for your traffic")
    parts = [head]
    ctxs = sorted(t.engines[0].tuned.requests_at)
    for e in t.engines:
        rows = [[k, _v(e.default.flags.get(k, "-")), _v(v)] for k, v in e.tuned.flags.items()]
        rows.append(["token capacity", f"{e.default.token_capacity:,}", f"{e.tuned.token_capacity:,} "
                     f"({e.capacity_ratio:.2f}×)"])
        rows += [[f"requests @{_ctx(c)}", f"{e.default.requests_at[c]:,}", f"{e.tuned.requests_at[c]:,}"] for c in ctxs]
        rows += [[f"it logs {k}", _v(e.default.reported[k]), _v(v)] for k, v in e.tuned.reported.items()]
        table = render(["", "default", "tuned"], rows, title=f"{e.engine}: {e.command()}")
        parts.append(table + "\n" + "\n".join(f"- {w}" for w in e.why))
    if fitted is not None:
        tuned = t.engine("kvatlas").tuned.flags["--prefix-checkpoints"]
        if fitted.running_fitted:
            b = fitted.best
            parts.append(f"kvatlas resume points and running requests fitted to this workload (replayed with the tuned "
                         f"flags, --max-model-len the model's, bookkeeping backend):\n{fitted.table()}\n- start kvatlas "
                         f"with --max-running-requests {b.running} --max-model-len {t.model.max_position_embeddings} "
                         f"--prefix-checkpoints {b.checkpoints} ({b.share:g} of the budget) instead of "
                         f"{t.engine('kvatlas').tuned.max_running_requests:,} and {tuned:,}: it hit {b.hit_ratio:.2%} "
                         f"of the prompt tokens here with a mean TTFT of {b.ttft_mean_s:.2f} s, the most hits of the "
                         "counts whose TTFT was near the lowest")
        else:
            parts.append(f"kvatlas resume points fitted to this workload (replayed with the tuned flags, bookkeeping "
                         f"backend):\n{fitted.table()}\n- start kvatlas with --prefix-checkpoints "
                         f"{fitted.best.checkpoints} ({fitted.best.share:g} of the budget) instead of {tuned:,}: it hit "
                         f"{fitted.best.hit_ratio:.2%} of the prompt tokens here, the most of the shares replayed")
    if simulated:
        cols = [c for c in ("default", "tuned", "fitted") if c in simulated]
        rows = [[k.replace("_", " "), *(_v(simulated[c][k]) for c in cols)] for k in simulated["tuned"]]
        parts.append(render(["", *cols], rows, title="kvatlas simulated on this workload (bookkeeping "
                            "backend): prefix hits and queueing") + f"\ntime model: a pass = {t.pace.pass_s * 1e3:g} ms + {t.pace.prefill_s_per_token * 1e6:g} µs × prefill "
                     f"tokens + {t.pace.decode_s_per_token * 1e6:g} µs × decode tokens (hit tokens are not prefilled)")
    return "\n\n".join(parts)


def _v(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if v < 1 else f"{v:,.2f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)
