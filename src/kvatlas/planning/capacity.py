"""What a plan means for requests, and its JSON form (a versioned schema)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .planner import CONTEXTS, PLAN_SCHEMA_VERSION, Plan, _Sizer, check_plan, checkpoint_unit_bytes, max_concurrency
from ..units import cdiv


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumePoints:
    """The prefix cache's resume points and what they cost: `count` units (the `kept` ones the
    option asks for, plus one being saved per running request and those one prefill chunk can
    cross), `bytes_each` (a checkpoint unit and its SWA tail pages), and the token capacity the
    same budget would hold without them."""

    kept: int
    count: int
    bytes_each: int
    total_bytes: int
    tokens_without: int
    token_capacity_cost: int


def resume_points(p: Plan) -> ResumePoints | None:
    if not p.sizing.checkpoint_units:
        return None
    bare = replace(p.options, prefix_checkpoints=0)
    sizer = _Sizer(p.model, bare)
    requests = p.sizing.requests
    reach = requests * cdiv(bare.max_model_len, bare.page_tokens) if sizer.page_price else 0
    pages = min(max(sizer.max_pages(requests, p.budget_bytes), 0), reach)
    without = pages * bare.page_tokens if p.has_compressed else p.max_total_tokens
    return ResumePoints(kept=p.options.prefix_checkpoints, count=p.sizing.checkpoint_units,
                        bytes_each=checkpoint_unit_bytes(p.buffers, p.sizing), total_bytes=p.checkpoint_bytes,
                        tokens_without=without, token_capacity_cost=without - p.max_total_tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class Capacity:
    max_total_tokens: int
    bytes_per_token: float        # slope: page-padded bytes one more cached token costs
    row_bytes_per_token: float    # the same from row sizes alone (SPEC §5), no page padding
    bytes_per_request: int        # intercept: fixed bytes of one running request
    shared_bytes: int             # once per rank: null units, in-flight prefill SWA, workspace, alignment
    resume_points: ResumePoints | None   # the prefix cache's, when it is on
    dead_bytes: int               # padding and null units: allocated, never holding data
    unused_bytes: int             # budget left unallocated (nothing could address it)
    total_bytes: int
    concurrency: dict             # context → (fits in the budget, fits in this plan)

    @property
    def dead_share(self) -> float:
        return self.dead_bytes / self.total_bytes


def capacity(p: Plan, contexts=CONTEXTS) -> Capacity:
    check_plan(p)
    return Capacity(
        max_total_tokens=p.max_total_tokens, bytes_per_token=p.bytes_per_token,
        row_bytes_per_token=p.row_bytes_per_token, bytes_per_request=p.bytes_per_request,
        shared_bytes=p.shared_bytes, resume_points=resume_points(p), dead_bytes=p.dead_bytes, unused_bytes=p.unused_bytes,
        total_bytes=p.total_bytes, concurrency={c: (max_concurrency(p, c), p.concurrency_in_plan(c)) for c in contexts},
    )


def plan_to_dict(p: Plan, contexts=CONTEXTS) -> dict:
    check_plan(p)
    cap = capacity(p, contexts)
    o = p.options
    return {
        "schema": "kvatlas.plan", "schema_version": PLAN_SCHEMA_VERSION,
        "model": p.model.name, "family": p.model.family,
        "options": {
            "kv_layout": o.kv_layout, "indexer": o.indexer, "state_dtype": o.state_dtype,
            "online_c128": o.online_c128, "page_tokens": o.page_tokens, "swa_page_tokens": o.swa_page_tokens,
            "max_running_requests": o.max_running_requests, "draft_tokens": o.draft_tokens,
            "draft_layers": o.draft_layers, "chunked_prefill_tokens": o.chunked_prefill_tokens,
            "max_model_len": o.max_model_len, "tp": o.tp, "pp": o.pp, "dp": o.dp, "pp_rank": o.pp_rank,
        },
        "layers": [{"index": l.index, "kind": l.kind.value, "draft": l.is_draft,
                    "stores_compressed": l.stores_compressed} for l in p.layers],
        "budget_bytes": p.budget_bytes, "total_bytes": p.total_bytes, "unused_bytes": p.unused_bytes,
        "weights": _weights(p),
        "units": dict(p.units),
        "capacity": {
            "max_total_tokens": cap.max_total_tokens, "max_running_requests": p.max_running_requests,
            "bytes_per_token": cap.bytes_per_token, "row_bytes_per_token": cap.row_bytes_per_token,
            "bytes_per_request": cap.bytes_per_request, "shared_bytes": cap.shared_bytes,
            "dead_bytes": cap.dead_bytes, "dead_share": cap.dead_share,
            "resume_points": None if cap.resume_points is None else {
                "kept": cap.resume_points.kept, "count": cap.resume_points.count,
                "bytes_each": cap.resume_points.bytes_each, "total_bytes": cap.resume_points.total_bytes,
                "max_total_tokens_without": cap.resume_points.tokens_without,
                "token_capacity_cost": cap.resume_points.token_capacity_cost},
            "concurrency": [{"context_tokens": c, "max_requests": fit, "in_plan": inplan}
                            for c, (fit, inplan) in cap.concurrency.items()],
        },
        "buffers": [b.to_dict() for b in p.buffers],
    }


def _weights(p: Plan) -> dict | None:
    """The weights beside the budget: None when the budget was given (--memory)."""
    o = p.options
    if o.memory_bytes is not None:
        return None
    out = {"bytes": o.weights_bytes, "from_config": o.weights_from_config, "gpu": o.gpu,
           "mem_fraction": o.mem_fraction}
    if o.weights_from_config:
        w = o.auto_weights(p.model, o)
        out.update(by_part=dict(w.by_part), assumptions=list(w.assumptions))
    return out
