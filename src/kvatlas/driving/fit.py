"""How many resume points: the prefix cache's share of the budget fitted to a workload by replay.

The plan splits the budget between full pages and resume points (`prefix_checkpoints`: a unit of
compressor state and its SWA tail each, about four full pages' bytes on V4-Flash), and the pools
are fixed once allocated. Which split hits most depends on the budget and the workload: on the
Mooncake trace a tenth of 16 GiB in resume points hits 17% more prompt tokens than a quarter, and
at 120 GiB two fifths hit most (bench/RESULTS.md, "How many resume points"). So the count is
fitted before the cache is allocated: the workload is replayed through the simulator, bookkeeping
only, once per candidate share, and the count that hit the most prompt tokens is the fit.

Candidates: SHARES of the budget, then the midpoints between the best and its neighbours (the
hit against the share rose to one peak and fell on every budget measured). Every replay uses the
same requests, time model and admission as the run it fits; a share whose plan does not fit the
budget is left out, said so in the table. The device cache alone is replayed (a host tier would
hold what it evicts: fitted without it, its count is what the device's pools should hold).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import whole
from ..errors import BudgetError, ConfigError
from ..planning.capacity import resume_points
from ..planning.planner import plan as make_plan

SHARES = (0.05, 0.1, 0.15, 0.25, 0.4)


@dataclass(frozen=True, slots=True, kw_only=True)
class Trial:
    share: float          # of the budget, in resume points
    checkpoints: int      # prefix_checkpoints the share buys
    full_pages: int       # what the plan's full-page pool then holds
    hit_tokens: int
    queried_tokens: int
    refused: str = ""     # the plan did not fit: why

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(frozen=True, slots=True)
class Fit:
    trials: tuple[Trial, ...]      # in the order of their shares
    best: Trial

    def table(self) -> str:
        rows = [f"{'share':>6} {'resume points':>13} {'full pages':>10} {'hit':>7}"]
        for t in self.trials:
            hit = "does not fit the budget" if t.refused else f"{t.hit_ratio:7.2%}"
            mark = "  <- fitted" if t is self.best else ""
            n, pages = ("-", "-") if t.refused else (f"{t.checkpoints:,}", f"{t.full_pages:,}")
            rows.append(f"{t.share:6.3f} {n:>13} {pages:>10} {hit}{mark}")
        return "\n".join(rows)

    def to_dict(self) -> dict:
        return {"checkpoints": self.best.checkpoints, "share": self.best.share, "hit_ratio": self.best.hit_ratio,
                "trials": [{"share": t.share, "checkpoints": t.checkpoints, "full_pages": t.full_pages,
                            "hit_tokens": t.hit_tokens, "queried_tokens": t.queried_tokens,
                            **({"refused": t.refused} if t.refused else {})} for t in self.trials]}


def default_jobs() -> int:
    """Replays at once where the caller does not say: the CPUs this process may use, at most 8."""
    import os
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, 8))


def checkpoints_for_share(model, share: float, **options) -> int:
    """Resume points worth `share` of the plan's budget (options as plan() takes them, without
    prefix_checkpoints): the budget over what one point costs (its unit and SWA tail pages)."""
    if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0.0 < share < 1.0:
        raise ConfigError("share", f"{share!r} is not a share of the budget", "give a number between 0 and 1, e.g. 0.15")
    probe = make_plan(model, **{**options, "prefix_checkpoints": 1})
    return max(1, int(share * probe.budget_bytes // resume_points(probe).bytes_each))


def fit_checkpoints(model, requests, *, shares=SHARES, refine: bool = True, simulator: dict | None = None,
                    progress=None, jobs: int = 1, **options) -> Fit:
    """Replay `requests` once per candidate share (module doc) and return every trial and the
    best (the most hit prompt tokens; ties: `_best`). `options`: plan()'s, without
    prefix_checkpoints; `simulator`: the Simulator's keyword arguments the run will use (time
    model, admission, seed); `progress(trial)`, if given, hears each trial as it ends; `jobs`:
    replays run at once, each in a process of its own (the grid's, then the refinement's)."""
    whole("jobs", jobs, 1, 1024)
    if options.get("prefix_checkpoints"):
        raise ConfigError("prefix_checkpoints", "given to the fit that chooses it", "drop it: the fit returns the count")
    try:
        shares = sorted({float(s) for s in shares})
    except (TypeError, ValueError):
        raise ConfigError("shares", f"{shares!r} is not a list of numbers", f"give e.g. {SHARES}") from None
    if not shares:
        raise ConfigError("shares", "no candidate share", f"give some, e.g. {SHARES}")
    for s in shares:
        if not 0.0 < s < 1.0:
            raise ConfigError("shares", f"{s!r} is not a share of the budget", "give numbers between 0 and 1")
    requests = list(requests)
    if not requests:
        raise ConfigError("requests", "no request to replay", "give the workload the cache will serve")
    done: dict[float, Trial] = {}

    def record(t: Trial) -> None:
        done[t.share] = t
        if progress is not None:
            progress(t)

    def run(batch) -> None:
        args = [(model, s, requests, simulator or {}, options) for s in dict.fromkeys(batch) if s not in done]
        if jobs == 1 or len(args) < 2:
            for a in args:
                record(_trial(*a))
            return
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        with ProcessPoolExecutor(max_workers=min(jobs, len(args)), mp_context=ctx) as pool:
            for f in [pool.submit(_trial, *a) for a in args]:
                record(f.result())

    run(shares)
    if refine:
        ok = [s for s in shares if not done[s].refused]
        if ok:
            best = _best(done[s] for s in ok).share
            i = ok.index(best)
            run([round((best + ok[j]) / 2, 4) for j in (i - 1, i + 1) if 0 <= j < len(ok)])
    trials = tuple(done[s] for s in sorted(done))
    fitting = [t for t in trials if not t.refused]
    if not fitting:
        raise BudgetError(f"prefix_checkpoints: no candidate share fits the budget ({trials[0].refused}); "
                          "give a larger budget or fewer running requests")
    return Fit(trials, _best(fitting))


def _best(trials) -> Trial:
    """The most hit tokens; on a tie the most full pages (what the next workload may want), then
    the most resume points (where the pages are capped by what requests can address, the points
    cost the budget nothing the pages could use)."""
    return max(trials, key=lambda t: (t.hit_tokens, t.full_pages, t.checkpoints))


def _trial(model, share: float, requests, sim_kwargs: dict, options: dict) -> Trial:
    from .measure import replay
    try:
        n = checkpoints_for_share(model, share, **options)
        p = make_plan(model, **{**options, "prefix_checkpoints": n})
    except BudgetError as exc:
        return Trial(share=share, checkpoints=0, full_pages=0, hit_tokens=0, queried_tokens=0, refused=str(exc))
    cache, _ = replay(p, requests, **sim_kwargs)
    s = cache.prefix.stats
    return Trial(share=share, checkpoints=n, full_pages=p.num_full_pages, hit_tokens=s.hit_tokens,
                 queried_tokens=s.queried_tokens)

