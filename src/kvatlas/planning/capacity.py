"""What a plan means for requests, and its JSON form (a versioned schema)."""

from __future__ import annotations

from dataclasses import dataclass

from .planner import CONTEXTS, PLAN_SCHEMA_VERSION, Plan, max_concurrency


@dataclass(frozen=True, slots=True, kw_only=True)
class Capacity:
    max_total_tokens: int
    bytes_per_token: float        # slope: page-padded bytes one more cached token costs
    row_bytes_per_token: float    # the same from row sizes alone (SPEC §5), no page padding
    bytes_per_request: int        # intercept: fixed bytes of one running request
    shared_bytes: int             # once per rank: null units, in-flight prefill SWA, workspace, alignment
    dead_bytes: int               # padding and null units: allocated, never holding data
    unused_bytes: int             # budget left unallocated (nothing could address it)
    total_bytes: int
    concurrency: dict             # context → (fits in the budget, fits in this plan)

    @property
    def dead_share(self) -> float:
        return self.dead_bytes / self.total_bytes


def capacity(p: Plan, contexts=CONTEXTS) -> Capacity:
    return Capacity(
        max_total_tokens=p.max_total_tokens, bytes_per_token=p.bytes_per_token,
        row_bytes_per_token=p.row_bytes_per_token, bytes_per_request=p.bytes_per_request,
        shared_bytes=p.shared_bytes, dead_bytes=p.dead_bytes, unused_bytes=p.unused_bytes,
        total_bytes=p.total_bytes, concurrency={c: (max_concurrency(p, c), p.concurrency_in_plan(c)) for c in contexts},
    )


def plan_to_dict(p: Plan, contexts=CONTEXTS) -> dict:
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
