"""`kvatlas compare`: what SGLang and vLLM would allocate for the same deployment, beside kvatlas."""

from __future__ import annotations

import json

from ..engines import DEFAULT_LINEUP, compare
from ..engines.base import TABLE_CONTEXTS
from ..engines.verdict import verdict
from ..observing.progress import Bar, wanted
from ..observing.table import render
from ..units import fmt_bytes
from ..errors import ConfigError
from .common import add_deployment_args, check_output_file, count, gpu_of, number, options_from_args

SCHEMA_VERSION = 1


def add_parser(p) -> None:
    add_deployment_args(p)
    g = p.add_argument_group("engines")
    g.add_argument("--engines", default=",".join(DEFAULT_LINEUP),
                   help="comma list of engine[:variant]: kvatlas, sglang (0.5.23's real default, ratio 0.1), "
                        f"sglang:ratio, sglang:cap, vllm (0.34, the newest modelled), vllm@0.33, vllm:sync "
                        f"(default: {','.join(DEFAULT_LINEUP)})")
    g.add_argument("--sglang-swa-ratio", type=number(0.0, 1.0, open_low=True),
                   help="SGLang --swa-full-tokens-ratio (ratio mode)")
    g.add_argument("--sglang-prefix-tails", type=count(0), help="SGLang --swa-prefix-tails (cap mode headroom)")
    g.add_argument("--sglang-no-radix", action="store_true", help="SGLang with --disable-radix-cache")
    g.add_argument("--sglang-platform", choices=("cuda", "hip"), help="prices the fp4 indexer at 68 B on hip")
    g.add_argument("--vllm-max-num-batched-tokens", type=count(1),
                   help="default: vLLM's own for --vllm-entrypoint on --gpu (8,192 for serve on an H200)")
    g.add_argument("--vllm-entrypoint", choices=("serve", "offline"),
                   help="whose defaults vLLM takes: `vllm serve` (default) or the offline LLM class")
    g.add_argument("--vllm-sync", action="store_true", help="vLLM without async scheduling (one batch in flight)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON (schema kvatlas.compare v1)")
    p.add_argument("--plot", metavar="FILE.png", help="also draw memory by pool and concurrency vs context")


def engine_options(args) -> dict:
    sg = {"swa_ratio": args.sglang_swa_ratio, "prefix_tails": args.sglang_prefix_tails,
          "radix_cache": False if args.sglang_no_radix else None, "platform": args.sglang_platform}
    vl = {"max_num_batched_tokens": args.vllm_max_num_batched_tokens,
          "async_scheduling": False if args.vllm_sync else None, "entrypoint": args.vllm_entrypoint}
    out = {"sglang": {k: v for k, v in sg.items() if v is not None},
           "vllm": {k: v for k, v in vl.items() if v is not None}}
    return {k: v for k, v in out.items() if v}


def run(args) -> int:
    check_output_file("--plot", args.plot)
    lineup = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not lineup:
        raise ConfigError("--engines", f"{args.engines!r} names no engine",
                          f"give a comma list such as {','.join(DEFAULT_LINEUP)}")
    with Bar(len(lineup), "compare", wanted(quiet=args.json), unit="engines") as bar:
        results = compare(args.model, lineup=lineup, engine_options=engine_options(args),
                          on_result=lambda i, r: bar.update(i), **options_from_args(args))
    base = next((r for r in results if r.engine == "kvatlas"), None)
    if args.json:
        print(json.dumps(to_dict(results, base, gpu_of(args)), indent=2))
    else:
        print(text_report(results, base, gpu_of(args)))
    if args.plot:
        from ..engines.plot import plot_compare
        plot_compare(results, args.plot)
        if not args.json:
            print(f"\nplot written to {args.plot}")
    return 0


def token_ratio(base, r) -> float | None:
    """How many times the engine's token capacity kvatlas holds for the same deployment."""
    if base is None or not r.token_capacity:
        return None
    return base.token_capacity / r.token_capacity


def to_dict(results, base, gpu: str) -> dict:
    first = results[0]
    return {"schema": "kvatlas.compare", "schema_version": SCHEMA_VERSION, "model": first.model,
            "budget_bytes": first.budget_bytes, "gpu": gpu, "contexts": list(TABLE_CONTEXTS),
            "verdicts": [verdict(r, base) for r in results],
            "engines": [{**r.to_dict(), "kvatlas_token_ratio": token_ratio(base, r), "verdict": verdict(r, base)}
                        for r in results]}


def _signed(n: int) -> str:
    return f"+{n:,}" if n > 0 else f"{n:,}"


def _name(r) -> str:
    return f"{r.engine} [{r.variant}]" + (" REFUSED" if r.refused else "")


def memory_rows(results) -> list[list]:
    rows = []
    for r in results:
        share = 100 * r.dead_bytes / r.allocated_bytes if r.allocated_bytes else 0.0
        rows.append([_name(r), f"{r.allocated_bytes:,}", fmt_bytes(r.allocated_bytes), _signed(r.over_budget_bytes),
                     f"{r.outside_bytes:,}", f"{r.reachable_bytes:,}", f"{r.dead_bytes:,}", f"{share:.2f}%",
                     f"{r.unreachable_bytes:,}"])
    return rows


def capacity_rows(results, base) -> list[list]:
    rows = []
    for r in results:
        ratio = token_ratio(base, r)
        rows.append([_name(r), f"{r.token_capacity:,}", "-" if ratio is None else f"{ratio:.3f}×",
                     *(f"{r.concurrency[c]:,}" for c in TABLE_CONTEXTS)])
    return rows


def reported_rows(results) -> list[list]:
    rows = []
    for r in results:
        rep = r.reported
        gauge = "none" if rep.memory_gauge_bytes is None else f"{rep.memory_gauge_bytes:,}"
        logged = "-" if rep.capacity_tokens is None else f"{rep.capacity_tokens:,}"
        rows.append([_name(r), f"{rep.capacity_label}: {logged}", f"{r.token_capacity:,}", gauge,
                     f"{r.allocated_bytes + r.outside_bytes:,}"])
    return rows


def setting_lines(results, gpu: str) -> list[str]:
    """What each engine's figures assume, and which rows the engine would refuse on that GPU."""
    plain = [f"{r.engine} [{r.variant}]" for r in results]
    lines = [f"- {n}: assumes {r.assumes}" for n, r in zip(plain, results) if r.assumes]
    lines += [f"- {n}: REFUSED on {gpu}: {r.refused}; its rows show what it would allocate where it starts"
              for n, r in zip(plain, results) if r.refused]
    return lines


def text_report(results, base, gpu: str = "h200") -> str:
    first = results[0]
    head = "\n".join([f"kvatlas compare — {first.model}, budget {fmt_bytes(first.budget_bytes)} "
                      f"({first.budget_bytes:,} B) per rank, max running {first.max_running_requests}, GPU {gpu}",
                      *setting_lines(results, gpu)])
    ctx = [f"@{c // 1024:,}K" if c < 2**20 else f"@{c // 2**20}M" for c in TABLE_CONTEXTS]
    memory = render(["engine", "allocated B", "", "vs budget B", "outside budget B", "reachable B", "dead B",
                     "dead", "of which unreachable B"], memory_rows(results), title="memory")
    cap = render(["engine", "token capacity", "kvatlas ÷ engine", *(f"requests {c}" for c in ctx)],
                 capacity_rows(results, base), title="capacity (same budget, same request limit)")
    rep = render(["engine", "it reports (tokens)", "truth (tokens)", "its memory gauge B", "truth B (all tensors)"],
                 reported_rows(results), title="what the engine reports vs the truth")
    if base is not None:
        planned = base.figures["concurrency_if_planned_for"]
        cap += ("\nkvatlas re-planned for one context (max running set to fit it): "
                + ", ".join(f"{c} {planned[n]:,}" for c, n in zip(ctx, TABLE_CONTEXTS)))
    notes = [f"- {_name(r)}: {n}" for r in results for n in r.notes]
    verdicts = "verdicts\n" + "\n".join(f"- {verdict(r, base)}" for r in results)
    parts = [head, verdicts, memory, cap, rep]
    if notes:
        parts.append("notes\n" + "\n".join(notes))
    return "\n\n".join(parts)
