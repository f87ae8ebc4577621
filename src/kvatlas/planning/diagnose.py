"""Why a budget cannot hold the deployment, and the smallest change that fits.

The planner's refusal names the option that made the request too big, not a fixed list of
usual suspects: an option above its default whose default alone would fit (`draft_tokens`,
`chunked_prefill_tokens`, `prefix_checkpoints`, `page_tokens`, `swa_page_tokens`; the config's
`sliding_window` against DeepSeek-V4's 128) is the cause, and the largest value of it that fits
is the change. Without such a cause the changes are the sizes asked for (`max_running_requests`,
`max_model_len`, each the largest that fits alone) and the budget (`memory_bytes`, the smallest
that fits). Options are named as Python arguments; the CLI shows them as flags. Runs only on
the error path: a few hundred sizings, some tens of milliseconds.
"""

from __future__ import annotations

from dataclasses import fields, replace

from .model import ModelSpec
from .options import ServeOptions
from ..errors import BudgetError, KvatlasError
from ..units import cdiv, fmt_bytes

# option -> grid step (values stay multiples of it: the planner refuses others)
_CAUSES = {"draft_tokens": 1, "chunked_prefill_tokens": 1, "prefix_checkpoints": 1, "page_tokens": 128,
           "swa_page_tokens": 64}
_SIZES = ("max_running_requests", "max_model_len")
V4_SLIDING_WINDOW = 128
_DEFAULTS = {f.name: f.default for f in fields(ServeOptions)}


def fits_with(sizer_for, budget: int):
    """`fits(model, opts)`: whether one request of max_model_len fits `budget` beside the others.
    `sizer_for(model, validated opts)` is the planner's sizer (passed in: the planner builds on
    this module, not the other way round)."""
    def fits(model: ModelSpec, opts: ServeOptions) -> bool:
        try:
            sizer = sizer_for(model, opts.validated())
        except KvatlasError:   # a value the planner refuses for another reason does not "fit"
            return False
        one = cdiv(opts.max_model_len, opts.page_tokens) if sizer.page_price else 0
        return sizer.max_pages(opts.running_requests_per_rank, budget) >= one
    return fits


def _largest_fit(fits, low: int, high: int, step: int) -> int | None:
    """The largest multiple of `step` in [low, high) that fits (fits(high) is False), or None."""
    lo, hi = -(-low // step), (high - 1) // step
    if hi < lo or not fits(lo * step):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid - 1)
    return lo * step


def _causes(model: ModelSpec, opts: ServeOptions, fits) -> list[tuple[str, str]]:
    """(what, its fix) for each option above its default whose default alone fits."""
    out = []
    for name, step in _CAUSES.items():
        now, default = getattr(opts, name), _DEFAULTS[name]
        if now <= default or not fits(model, replace(opts, **{name: default})):
            continue
        best = _largest_fit(lambda v: fits(model, replace(opts, **{name: v})), default, now, step)
        out.append((f"{name}={now}", f"lower {name} to {best} (the largest that fits)"))
    raised = {n: _DEFAULTS[n] for n in _CAUSES if getattr(opts, n) > _DEFAULTS[n]}
    if not out and len(raised) > 1 and fits(model, replace(opts, **raised)):   # only together
        out.append((" and ".join(f"{n}={getattr(opts, n)}" for n in raised) + " together",
                    "lower them to " + ", ".join(f"{n}={v}" for n, v in raised.items()) + " (the defaults)"))
    window = model.sliding_window
    if window > V4_SLIDING_WINDOW and fits(replace(model, sliding_window=V4_SLIDING_WINDOW), opts):
        out.append((f"the model's config.sliding_window={window} (DeepSeek-V4's is {V4_SLIDING_WINDOW})", ""))
    return out


def _size_changes(model: ModelSpec, opts: ServeOptions, fits) -> list[str]:
    """The sizes asked for, each lowered alone to the largest value that fits."""
    out = []
    for name in _SIZES:
        now = getattr(opts, name)
        low = opts.dp if name == "max_running_requests" else 1
        best = _largest_fit(lambda v: fits(model, replace(opts, **{name: v})), low, now, 1)
        if best is not None:
            out.append(f"{name} to {best}")
    if not out:   # neither alone: the fewest requests, and the longest context that fits beside them
        one = replace(opts, max_running_requests=opts.dp)
        best = _largest_fit(lambda v: fits(model, replace(one, max_model_len=v)), 1, opts.max_model_len, 1)
        return [] if best is None else [f"lower max_running_requests to {opts.dp} and max_model_len to {best} "
                                        "(together; the largest that fits)"]
    return [f"lower {' or '.join(out)} ({'each ' if len(out) > 1 else ''}the largest that fits alone)"]


def budget_error(model: ModelSpec, opts: ServeOptions, budget: int, need: int, sizer_for) -> BudgetError:
    """The refusal of a budget below `need` (what the asked deployment takes); `sizer_for` as in
    `fits_with`."""
    fits = fits_with(sizer_for, budget)
    head = (f"memory_bytes: {fmt_bytes(budget)} ({budget:,} B) cannot hold {opts.running_requests_per_rank} running "
            f"requests plus one request of max_model_len={opts.max_model_len}: that needs {fmt_bytes(need)} "
            f"({need:,} B)")
    budget_fix = f"raise memory_bytes to {need}" if opts.memory_bytes is not None else f"give memory_bytes={need}"
    causes = _causes(model, opts, fits)
    if causes:
        names = " and ".join(c for c, _ in causes)
        fixes = [f for _, f in causes if f] or _size_changes(model, opts, fits)
        verb = "each make" if len(causes) > 1 else "make" if " and " in names else "makes"
        return BudgetError(f"{head}; {names} {verb} it too big: {', or '.join(fixes + [budget_fix])}")
    return BudgetError(f"{head}; {', or '.join(_size_changes(model, opts, fits) + [budget_fix])}")
