"""What a plan's prefix-cache resume points cost: bytes, share of the budget, tokens of capacity.

A resume point is one unit of the checkpoint buffers (the compressor-state rows at a page
boundary; V4.1: the window rows) plus, with paged SWA, the SWA pages of the window − 1 tokens
before it. The plan holds `prefix_checkpoints` kept ones and, beside them, one being saved per
running request and those one prefill chunk can cross (`planner.checkpoint_units`). Their
capacity cost is measured, not estimated: the same options and budget planned without resume
points hold `tokens` more tokens (0 when the pages are capped by what the slots can address).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .buffers import CHECKPOINTS, SWA_PAGES
from .options import ServeOptions


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeCost:
    units: int                 # resume points the plan holds (null excluded)
    kept: int                  # of those, the ones the cache may keep (prefix_checkpoints)
    unit_bytes: int            # one resume point: its rows and its SWA tail pages
    row_bytes: int             # the checkpoint buffers, as allocated
    swa_tail_bytes: int        # the SWA pages of every unit's tail
    budget_bytes: int
    tokens: int                # tokens of capacity the same budget holds without resume points

    @property
    def bytes(self) -> int:
        return self.row_bytes + self.swa_tail_bytes

    @property
    def budget_share(self) -> float:
        return self.bytes / self.budget_bytes


def resume_cost(plan) -> ResumeCost | None:
    """None when the plan has no prefix cache."""
    units = plan.sizing.checkpoint_units
    if not units:
        return None
    from .planner import plan as make_plan
    rows = [b for b in plan.buffers if b.group == CHECKPOINTS]
    swa_page = sum(b.unit_bytes for b in plan.buffers if b.group == SWA_PAGES)
    tail = plan.sizing.checkpoint_swa_pages
    budget_from = ("memory_bytes", "gpu", "mem_fraction", "weights_bytes", "weights_from_config")   # given: the budget
    opts = {f.name: getattr(plan.options, f.name) for f in fields(ServeOptions) if f.name not in budget_from}
    bare = make_plan(plan.model, **{**opts, "memory_bytes": plan.budget_bytes, "prefix_checkpoints": 0})
    return ResumeCost(units=units, kept=plan.options.prefix_checkpoints,
                      unit_bytes=sum(b.unit_bytes for b in rows) + tail * swa_page,
                      row_bytes=sum(b.bytes for b in rows), swa_tail_bytes=units * tail * swa_page,
                      budget_bytes=plan.budget_bytes, tokens=bare.max_total_tokens - plan.max_total_tokens)
