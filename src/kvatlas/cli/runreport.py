"""The summary rows `simulate` and `serve` add after a run: latency percentiles (all requests, and
with and without a prefix hit), the limit that held the run back with the flag that moves it,
and what the resume points cost."""

from __future__ import annotations

from ..driving.latency import GROUPS, PERCENTILES
from ..driving.limits import verdict
from ..units import fmt_bytes

_FIGURE_ROWS = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("queueing", "queue_s"), ("end to end", "e2e_s"))


def run_rows(cache, sim) -> list[list[str]]:
    summary = sim.latency.summary()
    groups = GROUPS if cache.prefix is not None else ("all",)
    rows = [[name + _LABEL[g], _figure_line(summary[g][key])] for name, key in _FIGURE_ROWS for g in groups]
    rows.append(["binding limit", verdict(sim.limits, cache.plan).text])
    if cache.prefix is not None:
        rows.append(["resume points", resume_line(cache.plan)])
    return rows


_LABEL = {"all": "", "hit": ", prefix hit", "miss": ", no hit"}


def _figure_line(s: dict) -> str:
    if not s["count"]:
        return "no finished request"
    ps = ", ".join(f"p{q} {fmt_s(s[f'p{q}'])}" for q in PERCENTILES)
    return f"{ps}, mean {fmt_s(s['mean'])} ({s['count']:,} requests)"


def fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1e3:.1f} ms" if abs(v) < 1 else f"{v:,.2f} s"


def resume_line(plan) -> str:
    from ..planning.capacity import resume_points
    c = resume_points(plan)
    return (f"{c.count:,} ({c.kept:,} kept + {c.count - c.kept:,} for requests and the chunk in flight), "
            f"{fmt_bytes(c.bytes_each)} each: {c.total_bytes:,} B ({fmt_bytes(c.total_bytes)}, "
            f"{100 * c.total_bytes / plan.budget_bytes:.2f}% of the budget); {c.token_capacity_cost:,} tokens of "
            f"capacity ({plan.max_total_tokens:,} held, {c.tokens_without:,} without them)")
