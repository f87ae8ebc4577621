"""`kvatlas plan`: the pools, their bytes and what they hold, as a table, JSON or a picture."""

from __future__ import annotations

import json

from ..planning.capacity import capacity, plan_to_dict
from ..observing.table import render
from ..errors import ConfigError
from ..units import fmt_bytes
from .common import add_deployment_args, check_output_file, options_from_args, parse_mix, plan_from_args


def add_parser(p) -> None:
    add_deployment_args(p)
    p.add_argument("--fit", metavar="NxCTX[,NxCTX]", help="the inverse: 8x128K (or a mix, 8x128K,32x4K) plans the "
                   "smallest budget that holds them at once; a bare context (128K) gives, for the budget, the "
                   "--max-running-requests that holds that context")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (schema kvatlas.plan v1)")
    p.add_argument("--plot", metavar="FILE.png", help="also draw memory by pool and concurrency vs context")


def run(args) -> int:
    check_output_file("--plot", args.plot)
    fit = parse_mix(args.fit, "--fit") if args.fit is not None else None
    if fit is not None and given(args, "--max-running-requests"):
        raise ConfigError("--max-running-requests", f"given beside --fit {args.fit}, which answers it",
                          "drop --max-running-requests (--fit NxCTX sets it to the requests of the mix; "
                          "--fit CTX prints it for the budget)")
    if fit and all(n is not None for n, _ in fit):
        p, weights = _smallest(args, fit)
        lines = [fit_line(p, fit, weights, given(args, "--weights"))]
    else:
        p = plan_from_args(args)
        lines = [] if fit is None else _running_for(p, fit)
    if args.json:
        doc = plan_to_dict(p)
        if fit:
            doc["fit"] = _fit_dict(p, fit)
        print(json.dumps(doc, indent=2))
    else:
        print("\n".join(lines + [text_report(p, sized=bool(fit) and fit[0][0] is not None)]))
    if args.plot:
        from ..observing.plan_plot import plot_plan
        plot_plan(p, args.plot)
        if not args.json:
            print(f"\nplot written to {args.plot}")
    return 0


def weights_line(p) -> str:
    """Where the budget came from: the GPU's share, less the weights (from the config, or given)."""
    from ..planning.options import GPU_MEMORY_BYTES
    o = p.options
    share = int(GPU_MEMORY_BYTES[o.gpu] * o.mem_fraction)
    if o.weights_from_config:
        w = o.auto_weights(p.model, o)
        parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(w.by_part.items(), key=lambda kv: -kv[1]))
        return (f"weights {o.weights_bytes:,} B ({fmt_bytes(o.weights_bytes)}) per rank from the config ({parts}); "
                f"{o.gpu} × {o.mem_fraction:g} = {share:,} B less the weights leaves {p.budget_bytes:,} B "
                f"({fmt_bytes(p.budget_bytes)}) of KV budget\nassumes: " + "; ".join(w.assumptions))
    if o.weights_bytes == 0:
        return "note: no weights share (--weights 0); the whole GPU fraction is counted as KV budget"
    return (f"weights {o.weights_bytes:,} B per rank (given); {o.gpu} × {o.mem_fraction:g} = {share:,} B less the "
            f"weights leaves {p.budget_bytes:,} B of KV budget")


def pool_rows(p) -> list[list]:
    rows = []
    for pool, bufs in p.pools().items():
        total = sum(b.bytes for b in bufs)
        b0 = bufs[0]
        rows.append([pool, b0.role, b0.layer_kind, len(b0.layers) or "-", f"{b0.units:,} {b0.group}",
                     f"{total:,}", fmt_bytes(total), f"{100 * total / p.total_bytes:.1f}%",
                     f"{sum(b.dead_bytes for b in bufs):,}"])
    return rows


def text_report(p, sized: bool = False) -> str:
    """The plan as text; `sized`: the budget is the one the plan was sized to (the inverse)."""
    o, cap = p.options, capacity(p)
    head = (f"kvatlas plan — {p.model.name} ({p.model.family}), layout {o.kv_layout}, indexer {o.indexer}, "
            f"state {o.state_dtype}{' online-C128' if o.online_c128 else ''}\n"
            f"budget {fmt_bytes(p.budget_bytes)} ({p.budget_bytes:,} B) per rank; tp={o.tp} pp={o.pp} dp={o.dp}"
            f" (stage {o.pp_rank}: {len(p.layers)} layers); max running {p.max_running_requests}; "
            f"max_model_len {o.max_model_len:,}; chunk {o.chunked_prefill_tokens:,}; draft tokens {o.draft_tokens}")
    if o.memory_bytes is None and not sized:
        head += "\n" + weights_line(p)
    pools = render(["pool", "role", "kind", "layers", "units", "bytes", "", "share", "dead bytes"], pool_rows(p))
    total = (f"total {p.total_bytes:,} B ({fmt_bytes(p.total_bytes)}), unused budget {p.unused_bytes:,} B, "
             f"dead {cap.dead_bytes:,} B ({100 * cap.dead_share:.2f}% of the total)")
    conc = render(["context", "max requests (budget)", f"in this plan (max running {p.max_running_requests})"],
                  [[f"{c:,}", f"{fit:,}", f"{inplan:,}"] for c, (fit, inplan) in cap.concurrency.items()])
    figures = (f"token capacity   {cap.max_total_tokens:,} tokens\n"
               f"per token        {cap.bytes_per_token:,.2f} B (page-padded; {cap.row_bytes_per_token:,.4f} B from rows alone)\n"
               f"per request      {cap.bytes_per_request:,} B ({fmt_bytes(cap.bytes_per_request)}) fixed while running\n"
               f"shared           {cap.shared_bytes:,} B (null units, in-flight prefill SWA, alignment)")
    rp = cap.resume_points
    if rp is not None:
        figures += (f"\nresume points    {rp.count:,} ({rp.kept:,} to keep + {rp.count - rp.kept:,} "
                    f"being saved by running requests and a prefill chunk) × {rp.bytes_each:,} B = {rp.total_bytes:,} B ({fmt_bytes(rp.total_bytes)}); they "
                    f"cost {rp.token_capacity_cost:,} tokens of capacity ({rp.tokens_without:,} without them)")
    return "\n\n".join([head, pools, total, figures, conc])


def given(args, flag: str) -> bool:
    """Whether the command line typed `flag` (a default is not a choice the user made)."""
    return any(a == flag or a.startswith(flag + "=") for a in getattr(args, "argv", None) or [])


def _smallest(args, fit):
    """The smallest KV budget for the mix, refused where it and the weights do not fit the GPU
    share (--gpu × --mem-fraction), naming the smallest --tp that fits when there is one."""
    from ..planning.options import GPU_MEMORY_BYTES
    from ..planning.planner import budget_for_mix
    if any(n is None for n, _ in fit):
        raise ConfigError("--fit", "mixes counted parts (8x128K) with bare contexts (128K)",
                          "give every part a count to size a budget, or none to size max running requests")
    if args.memory is not None:
        raise ConfigError("--memory", f"given beside --fit {args.fit}, which sizes the budget",
                          "drop --memory, or give --fit with bare contexts (--fit 128K) to size "
                          "--max-running-requests for that budget")
    longest = max(ctx for _, ctx in fit)
    if args.max_model_len is not None and longest > args.max_model_len:
        raise ConfigError("--fit", f"asks for {longest:,}-token contexts, longer than --max-model-len {args.max_model_len:,}",
                          "raise --max-model-len, or drop it (it is then the longest context of the mix)")
    opts = options_from_args(args)
    opts.pop("memory_bytes")   # the budget is what is asked for
    weights = opts.pop("weights_bytes", "auto")   # the KV budget alone; the weights and the GPU
    fraction = opts.pop("mem_fraction", 0.9)        # share only check that it fits beside them
    opts.pop("max_running_requests")   # as many slots as requests in the mix
    if opts["max_model_len"] is None:
        opts.pop("max_model_len")      # the longest context of the mix
    p = budget_for_mix(args.model, fit, **opts)
    o = p.options
    share = int(GPU_MEMORY_BYTES[o.gpu] * fraction)
    w = _weights_of(p, o) if weights == "auto" else weights
    if p.total_bytes + w <= share:
        return p, w
    want = " + ".join(f"{n:,} × {ctx:,}" for n, ctx in fit)
    hint = None
    if weights == "auto":
        for tp in (2, 4, 8, 16, 32, 64):
            if tp <= o.tp:
                continue
            try:
                q = budget_for_mix(args.model, fit, **{**opts, "tp": tp})
            except ConfigError:   # this tp does not divide the heads or experts
                continue
            if q.total_bytes + _weights_of(q, q.options) <= share:
                hint = f"use --tp {tp} (the smallest that fits)"
                break
    raise ConfigError("--fit", f"{want} tokens at once need {p.total_bytes:,} B of KV per rank beside {w:,} B of "
                      f"weights, {100 * (p.total_bytes + w) / GPU_MEMORY_BYTES[o.gpu]:.1f}% of one {o.gpu}, more than "
                      f"the {share:,} B --mem-fraction {fraction:g} gives at --tp {o.tp} --pp {o.pp}",
                      (hint or ("lower --weights (given per rank, whatever --tp), or ask for fewer or shorter requests"
                                if weights != "auto" else "no --tp holds it on one GPU: ask for fewer or shorter "
                                "requests, or spread them over --dp ranks"))
                      + (", or a larger --gpu" if o.gpu != "b200" else ""))


def _weights_of(p, o) -> int:
    return o.auto_weights(p.model, o).bytes if p.model.weights is not None else 0


def fit_line(p, fit, weights: int | None = None, weights_given: bool = False) -> str:
    """What the inverse found, and (`weights`, from the config or given) the GPU share it takes."""
    want = " + ".join(f"{n:,} × {ctx:,}" for n, ctx in fit)
    o = p.options
    line = (f"smallest budget for {want} tokens at once: {p.total_bytes:,} B ({fmt_bytes(p.total_bytes)}) per rank; "
            f"start with --memory {p.total_bytes} --max-running-requests {o.max_running_requests} "
            f"--max-model-len {o.max_model_len}" + (f" --tp {o.tp}" if o.tp > 1 else "") + (f" --pp {o.pp}" if o.pp > 1 else ""))
    if weights is None and p.model.weights is not None:
        weights = o.auto_weights(p.model, o).bytes
    if weights:
        from ..planning.options import GPU_MEMORY_BYTES
        gpu = GPU_MEMORY_BYTES[o.gpu]
        where = "given" if weights_given else f"from the config, per rank at tp={o.tp} pp={o.pp}"
        line += (f"\nwith the weights ({weights:,} B {where}) that is "
                 f"{weights + p.total_bytes:,} B, {100 * (weights + p.total_bytes) / gpu:.1f}% of one {o.gpu}")
    return line


def _running_for(p, fit) -> list[str]:
    from ..planning.planner import max_concurrency
    if any(n is not None for n, _ in fit):
        raise ConfigError("--fit", "mixes counted parts (8x128K) with bare contexts (128K)",
                          "give every part a count to size a budget, or none to size max running requests")
    out = []
    for _, ctx in fit:
        n = max_concurrency(p, ctx)
        out.append(f"for {ctx:,}-token contexts in {fmt_bytes(p.budget_bytes)} per rank: --max-running-requests {n:,} "
                   f"(the most requests of that length this budget holds at once)" if n else
                   f"for {ctx:,}-token contexts in {fmt_bytes(p.budget_bytes)} per rank: not one request fits "
                   f"(max_model_len {p.options.max_model_len:,}); raise --memory or --max-model-len")
    return out


def _fit_dict(p, fit) -> dict:
    from ..planning.planner import max_concurrency
    if all(n is not None for n, _ in fit):
        return {"kind": "smallest_budget", "mix": [{"requests": n, "context_tokens": c} for n, c in fit],
                "budget_bytes": p.total_bytes, "max_running_requests": p.max_running_requests}
    return {"kind": "max_running_requests", "budget_bytes": p.budget_bytes,
            "contexts": [{"context_tokens": c, "max_running_requests": max_concurrency(p, c)} for _, c in fit]}
