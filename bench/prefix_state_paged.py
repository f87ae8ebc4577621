"""What paging each request's compressor state and window per live request (as vLLM does) would
give kvatlas's prefix cache at 16 GiB on the shared trace, concurrent: an upper bound, emulated.

kvatlas holds every request slot's state rings and SWA window from the start, used or not: at
16 GiB, V4-Flash, 256 slots leave 8,462 full pages where a plan of few slots leaves about 14,300
(the difference, about 23 pages a slot). The emulation plans the same 256 slots at the budget
that leaves `--pages` full pages, and has every admitted request reserve `--state-pages` pages
more than it writes (its state, held until it finishes), so that the running requests' state
and the cache share one pool, as in an engine that pages that state. Everything else is
`bench/prefix_vllm.py`'s concurrent kvatlas run (the trace's arrivals, prefix-first admission over
4,096 waiting requests, queue-aware eviction, resume points 631 as at a 0.15 share). Both runs,
as kvatlas plans now (`--state-pages 0 --pages 8462`) and paged, in one call.

    python bench/prefix_state_paged.py --trace ../shared/traces/mooncake_synthetic.jsonl [--state-pages 23 --pages 14273]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import kvatlas

sys.path.insert(0, str(Path(__file__).resolve().parent))
import prefix_hit  # noqa: E402
import prefix_vllm  # noqa: E402

GIB, SLOTS, WINDOW = 16, 256, 4096


def plan_with_pages(pages: int, checkpoints: int):
    """The 256-slot plan at the smallest budget (to a MiB) that leaves at least `pages` full pages."""
    lo, hi = GIB << 30, 4 * GIB << 30
    while hi - lo > 1 << 20:
        mid = (lo + hi) // 2
        if kvatlas.plan("deepseek-v4-flash", mid, prefix_checkpoints=checkpoints,
                        max_running_requests=SLOTS).num_full_pages < pages:
            lo = mid
        else:
            hi = mid
    return kvatlas.plan("deepseek-v4-flash", hi, prefix_checkpoints=checkpoints, max_running_requests=SLOTS)


def run(p, requests, state_pages: int) -> dict:
    cache = kvatlas.allocate(p, backend="none")
    extra = state_pages * p.page_tokens   # reserved as if generated: pages held until the request ends
    can_admit, admit = cache.can_admit, cache.admit
    cache.can_admit = lambda prompt, new=0, **kw: can_admit(prompt, new + extra, **kw)
    cache.admit = lambda rid, prompt, new=0, **kw: admit(rid, prompt, new + extra, **kw)
    r = prefix_vllm.kvatlas_concurrent(p, requests, prefix_vllm.default_time_model(), window=WINDOW, cache=cache)
    return {"pages": p.num_full_pages, "hit": int(r["hits"].sum()) / sum(x.prompt_tokens for x in requests),
            "passes": r["passes"], "ttft": r["ttft_s"]["mean"], "peak_running": r["peak_running"],
            "evicted_awaited": r["evicted_awaited_pages"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--state-pages", type=int, default=23, help="pages a running request's state takes (default 23)")
    ap.add_argument("--pages", type=int, default=14273, help="full pages of the paged plan (default 14,273: "
                    "8,462 + 256 × 22.7, what the slots' state and windows take now)")
    args = ap.parse_args()
    base = prefix_hit.make_plan(GIB, 0.15, max_running_requests=SLOTS)
    _, requests = prefix_vllm.load(args.trace, 0)
    rows = [("as planned now", run(base, requests, 0)),
            ("state paged per live request", run(plan_with_pages(args.pages, base.options.prefix_checkpoints),
                                                 requests, args.state_pages))]
    print("| kvatlas | full pages | hit (prompt tokens) | passes | TTFT mean s | peak running | awaited pages evicted |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['pages']:,} | {r['hit']:.2%} | {r['passes']:,} | {r['ttft']:.2f} | {r['peak_running']} "
              f"| {r['evicted_awaited']} |")
    print(f"paged / as planned: {rows[1][1]['hit'] / rows[0][1]['hit']:.4f}x the hits")


if __name__ == "__main__":
    main()
