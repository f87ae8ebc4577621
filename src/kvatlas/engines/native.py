"""kvatlas's own plan in the same terms as the engine models, so one table holds all three."""

from __future__ import annotations

from ..planning.model import ModelSpec
from ..planning.options import ServeOptions
from ..planning.planner import Plan, max_concurrency, plan
from .base import CURVE_CONTEXTS, TABLE_CONTEXTS, EngineBuffer, EngineResult, Reported, split_options

ENGINE = "kvatlas"
OPTIONS: dict = {}


def from_plan(p: Plan) -> EngineResult:
    """Wrap a plan: its buffers already count null units and padding as dead, and nothing it
    allocates is unreachable (the planner never sizes what no index can address)."""
    bufs = tuple(EngineBuffer(spec=b, aligned=True) for b in p.buffers)
    contexts = sorted(set(TABLE_CONTEXTS + CURVE_CONTEXTS))
    reported = Reported(capacity_tokens=p.max_total_tokens, capacity_label="token capacity (plan)",
                        memory_gauge_bytes=p.total_bytes, gauge_label="kvatlas_memory_bytes (ledger)",
                        lines=(f"plan: {p.total_bytes:,} B in {len(p.buffers)} buffers of one slab",))
    figures = {"bytes_per_token": p.bytes_per_token, "row_bytes_per_token": p.row_bytes_per_token,
               "bytes_per_request": p.bytes_per_request, "shared_bytes": p.shared_bytes,
               "num_full_pages": p.num_full_pages, "num_swa_pages": p.num_swa_pages,
               # a plan reserves state for every request slot; re-planned for one context it holds more
               "concurrency_if_planned_for": {c: max_concurrency(p, c) for c in TABLE_CONTEXTS}}
    return EngineResult(engine=ENGINE, variant="plan", model=p.model.name, budget_bytes=p.budget_bytes,
                        buffers=bufs, token_capacity=p.max_total_tokens, pool_tokens=p.max_total_tokens,
                        max_running_requests=p.max_running_requests,
                        concurrency={c: p.concurrency_in_plan(c) for c in contexts}, reported=reported,
                        figures=figures)


def run(model: ModelSpec, opts: ServeOptions, budget: int, **engine_options) -> EngineResult:
    split_options(ENGINE, OPTIONS, engine_options)
    return from_plan(plan(model, budget, **_plan_options(opts)))


def _plan_options(opts: ServeOptions) -> dict:
    from dataclasses import asdict
    out = asdict(opts)
    for budget_part in ("memory_bytes", "gpu", "mem_fraction", "weights_bytes"):   # the budget is given
        out.pop(budget_part)
    return out
