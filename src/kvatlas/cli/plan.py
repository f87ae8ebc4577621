"""`kvatlas plan`: the pools, their bytes and what they hold, as a table, JSON or a picture."""

from __future__ import annotations

import json

from ..planning.capacity import capacity, plan_to_dict
from ..observing.table import render
from ..units import fmt_bytes
from .common import add_deployment_args, check_output_file, plan_from_args


def add_parser(p) -> None:
    add_deployment_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON (schema kvatlas.plan v1)")
    p.add_argument("--plot", metavar="FILE.png", help="also draw memory by pool and concurrency vs context")


def run(args) -> int:
    check_output_file("--plot", args.plot)
    p = plan_from_args(args)
    if args.json:
        print(json.dumps(plan_to_dict(p), indent=2))
    else:
        print(text_report(p))
    if args.plot:
        from ..observing.plan_plot import plot_plan
        plot_plan(p, args.plot)
        if not args.json:
            print(f"\nplot written to {args.plot}")
    return 0


def pool_rows(p) -> list[list]:
    rows = []
    for pool, bufs in p.pools().items():
        total = sum(b.bytes for b in bufs)
        b0 = bufs[0]
        rows.append([pool, b0.role, b0.layer_kind, len(b0.layers) or "-", f"{b0.units:,} {b0.group}",
                     f"{total:,}", fmt_bytes(total), f"{100 * total / p.total_bytes:.1f}%",
                     f"{sum(b.dead_bytes for b in bufs):,}"])
    return rows


def text_report(p) -> str:
    o, cap = p.options, capacity(p)
    head = (f"kvatlas plan — {p.model.name} ({p.model.family}), layout {o.kv_layout}, indexer {o.indexer}, "
            f"state {o.state_dtype}{' online-C128' if o.online_c128 else ''}\n"
            f"budget {fmt_bytes(p.budget_bytes)} ({p.budget_bytes:,} B) per rank; tp={o.tp} pp={o.pp} dp={o.dp}"
            f" (stage {o.pp_rank}: {len(p.layers)} layers); max running {p.max_running_requests}; "
            f"max_model_len {o.max_model_len:,}; chunk {o.chunked_prefill_tokens:,}; draft tokens {o.draft_tokens}")
    if o.memory_bytes is None and o.weights_bytes == 0:
        head += "\nnote: no weights share given (--weights); the whole GPU fraction is counted as KV budget"
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
