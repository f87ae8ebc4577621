"""One line per engine: what goes into a design doc from a `compare` run.

Each line says how many tokens the engine holds against kvatlas for the same deployment, whether
what it reports (its logged capacity, its memory gauge) is the truth, and what its bytes do
against the budget: over it, beside it, or unreachable by any index it computes.
"""

from __future__ import annotations

from ..units import fmt_bytes
from .base import EngineResult


def _reported(r: EngineResult) -> str:
    rep = r.reported
    parts = []
    if rep.capacity_tokens is not None:
        if rep.capacity_tokens == r.token_capacity:
            parts.append(f"its {rep.capacity_label} ({rep.capacity_tokens:,} tokens) is the truth")
        else:
            share = rep.capacity_tokens / r.token_capacity if r.token_capacity else 0.0
            parts.append(f"its {rep.capacity_label} says {rep.capacity_tokens:,} tokens, {share:.2f}× the "
                         f"{r.token_capacity:,} it holds")
    truth = r.allocated_bytes + r.outside_bytes
    if rep.memory_gauge_bytes is None:
        parts.append("no byte gauge")
    elif rep.memory_gauge_bytes == truth:
        parts.append("its memory gauge is exact")
    else:
        parts.append(f"its memory gauge reads {rep.memory_gauge_bytes:,} B of {truth:,} B")
    return ", ".join(parts)


def _bytes(r: EngineResult) -> str:
    over = r.over_budget_bytes
    parts = [f"{over:,} B ({fmt_bytes(over)}) over its budget" if over > 0 else "within its budget"]
    if r.outside_bytes:
        parts.append(f"{fmt_bytes(r.outside_bytes)} beside it")
    if r.unreachable_bytes:
        parts.append(f"{r.unreachable_bytes:,} B unreachable")
    return ", ".join(parts)


def verdict(r: EngineResult, base: EngineResult | None) -> str:
    """`engine [variant]: capacity; reports; bytes` — one line."""
    name = f"{r.engine} [{r.variant}]"
    if base is None or r is base or not r.token_capacity:
        cap = f"holds {r.token_capacity:,} tokens"
    else:
        ratio = base.token_capacity / r.token_capacity
        cap = (f"holds {r.token_capacity:,} tokens, kvatlas {ratio:.2f}× that" if ratio >= 1 else
               f"holds {r.token_capacity:,} tokens, {1 / ratio:.2f}× kvatlas")
    refused = f" — REFUSED on this GPU ({r.refused})" if r.refused else ""
    return f"{name}: {cap}; {_reported(r)}; {_bytes(r)}{refused}"
