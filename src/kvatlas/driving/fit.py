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

Running requests (`running=`, optional). Each request slot holds its compressor state and window
from the start whether a request uses it or not, so a small budget spends much of itself on slots:
V4-Flash at 16 GiB holds 8,462 full pages with 256 slots and 12,822 with 64, and on the Mooncake
trace 64 slots hit 56.0% of prompt tokens against 51.9% with 256, with about the same time to
first token, 128 slots 53.9% with less (bench/RESULTS.md, "Running requests as a setting"). Fewer slots also mean more passes,
so below some count the queue grows: the share is fitted for each candidate count as above, and the
count chosen is the one that hits most among those whose mean time to first token (the
simulator's virtual clock) is within `ttft_slack` of the lowest any candidate reached.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import real, whole
from ..errors import BudgetError, ConfigError
from ..planning.capacity import resume_points
from ..planning.options import ServeOptions
from ..planning.planner import plan as make_plan

SHARES = (0.05, 0.1, 0.15, 0.25, 0.4)
TTFT_SLACK = 0.1   # a running count may cost this much more mean TTFT than the best count's (module doc)


@dataclass(frozen=True, slots=True, kw_only=True)
class Trial:
    share: float          # of the budget, in resume points
    checkpoints: int      # prefix_checkpoints the share buys
    full_pages: int       # what the plan's full-page pool then holds
    hit_tokens: int
    queried_tokens: int
    running: int = 0      # the plan's max_running_requests
    ttft_mean_s: float = 0.0   # mean time to first token of the replay (virtual clock)
    refused: str = ""     # the plan did not fit: why

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(frozen=True, slots=True)
class Fit:
    trials: tuple[Trial, ...]      # in the order of their running counts, then of their shares
    best: Trial
    counts: tuple[int, ...] = ()   # the running counts fitted (none: the plan's own only)

    @property
    def running_fitted(self) -> bool:
        """Whether the running count was fitted (then the table shows each trial's and its TTFT)."""
        return bool(self.counts)

    def table(self) -> str:
        with_counts = self.running_fitted
        rows = [(f"{'running':>7} " if with_counts else "") + f"{'share':>6} {'resume points':>13} {'full pages':>10} "
                f"{'hit':>7}" + (f" {'TTFT mean':>9}" if with_counts else "")]
        for t in self.trials:
            hit = "does not fit the budget" if t.refused else f"{t.hit_ratio:7.2%}"
            if with_counts and not t.refused:
                hit += f" {t.ttft_mean_s:8.2f}s"
            mark = "  <- fitted" if t is self.best else ""
            n, pages = ("-", "-") if t.refused else (f"{t.checkpoints:,}", f"{t.full_pages:,}")
            rows.append((f"{t.running:>7} " if with_counts else "") + f"{t.share:6.3f} {n:>13} {pages:>10} {hit}{mark}")
        return "\n".join(rows)

    def to_dict(self) -> dict:
        return {"checkpoints": self.best.checkpoints, "share": self.best.share, "hit_ratio": self.best.hit_ratio,
                "max_running_requests": self.best.running,
                "trials": [{"share": t.share, "checkpoints": t.checkpoints, "full_pages": t.full_pages,
                            "hit_tokens": t.hit_tokens, "queried_tokens": t.queried_tokens,
                            "max_running_requests": t.running, "ttft_mean_s": t.ttft_mean_s,
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
    return points_for_share(make_plan(model, **{**options, "prefix_checkpoints": 1}), share)


def points_for_share(plan, share: float) -> int:
    """Resume points worth `share` of `plan`'s budget (checkpoints_for_share, for a plan at hand:
    what one point costs does not depend on how many the plan holds)."""
    return max(1, int(share * plan.budget_bytes // resume_points(plan).bytes_each))


def share_of_points(plan) -> float:
    """The share of the budget that buys exactly `plan`'s resume points (points_for_share rounds
    down: the share names the middle of the point's bytes)."""
    return (plan.options.prefix_checkpoints + 0.5) * resume_points(plan).bytes_each / plan.budget_bytes


def fit_checkpoints(model, requests, *, shares=SHARES, refine: bool = True, simulator: dict | None = None,
                    progress=None, jobs: int = 1, running=None, ttft_slack: float = TTFT_SLACK, **options) -> Fit:
    """Replay `requests` once per candidate share (module doc) and return every trial and the
    best (the most hit prompt tokens; ties: `_best`). `options`: plan()'s, without
    prefix_checkpoints; `simulator`: the Simulator's keyword arguments the run will use (time
    model, admission, seed); `progress(trial)`, if given, hears each trial as it ends; `jobs`:
    replays run at once, each in a process of its own (the grid's, then the refinement's).
    `running`: candidate max_running_requests (module doc; None: the plan's own count only), the
    share fitted for each; `ttft_slack`: how much more mean TTFT than the lowest a count may cost."""
    whole("jobs", jobs, 1, 1024)
    real("ttft_slack", ttft_slack, 0.0, 1e6)
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
    counts = running_counts(running, options)
    requests = list(requests)
    if not requests:
        raise ConfigError("requests", "no request to replay", "give the workload the cache will serve")
    done: dict[tuple, Trial] = {}   # (running count or None, share) -> trial

    def record(key, t: Trial) -> None:
        done[key] = t
        if progress is not None:
            progress(t)

    def run(batch) -> None:
        keys = [k for k in dict.fromkeys(batch) if k not in done]
        args = [(model, s, requests, simulator or {}, options if n is None else {**options, "max_running_requests": n})
                for n, s in keys]
        if jobs == 1 or len(args) < 2:
            for k, a in zip(keys, args):
                record(k, _trial(*a))
            return
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        with ProcessPoolExecutor(max_workers=min(jobs, len(args)), mp_context=ctx) as pool:
            for k, f in [(k, pool.submit(_trial, *a)) for k, a in zip(keys, args)]:
                record(k, f.result())

    run([(n, s) for n in counts for s in shares])
    if refine:
        middle = []
        for n in counts:
            ok = [s for s in shares if not done[n, s].refused]
            if ok:
                best = _best(done[n, s] for s in ok).share
                i = ok.index(best)
                middle += [(n, round((best + ok[j]) / 2, 4)) for j in (i - 1, i + 1) if 0 <= j < len(ok)]
        run(middle)
    trials = tuple(done[k] for k in sorted(done, key=lambda k: (k[0] or 0, k[1])))
    fitting = [t for t in trials if not t.refused]
    if not fitting:
        raise BudgetError(f"prefix_checkpoints: no candidate share fits the budget ({trials[0].refused}); "
                          "give a larger budget or fewer running requests")
    return Fit(trials, _best_running(fitting, ttft_slack), tuple(n for n in counts if n is not None))


def running_counts(running, options) -> list:
    """The candidate running counts ([None]: the plan's own), checked."""
    if running is None:
        return [None]
    if options.get("max_running_requests") is not None:
        raise ConfigError("max_running_requests", "given beside running counts to fit", "give one or the other")
    if isinstance(running, (str, bytes)) or not hasattr(running, "__iter__"):
        raise ConfigError("running", f"{running!r} is not a list of request counts", "give e.g. (64, 128, 256)")
    counts = sorted({whole("running", n, 1, 1 << 20) for n in running})
    if not counts:
        raise ConfigError("running", "no candidate count", "give some, e.g. (64, 128, 256)")
    return counts


def _best(trials) -> Trial:
    """The most hit tokens; on a tie the most full pages (what the next workload may want), then
    the most resume points (where the pages are capped by what requests can address, the points
    cost the budget nothing the pages could use)."""
    return max(trials, key=lambda t: (t.hit_tokens, t.full_pages, t.checkpoints))


def _best_running(trials, slack: float) -> Trial:
    """Each running count's best share (_best); of those, the count that hits most among the ones
    whose mean TTFT is within `slack` of the lowest (module doc); a tie: the fewer slots."""
    per = {}
    for t in trials:
        per.setdefault(t.running, []).append(t)
    bests = [_best(ts) for ts in per.values()]
    if len(bests) == 1:
        return bests[0]
    low = min(t.ttft_mean_s for t in bests)
    ok = [t for t in bests if t.ttft_mean_s <= low * (1.0 + slack)]
    return max(ok, key=lambda t: (t.hit_tokens, -t.running))


def _trial(model, share: float, requests, sim_kwargs: dict, options: dict) -> Trial:
    from .measure import replay
    try:
        n = checkpoints_for_share(model, share, **options)
        p = make_plan(model, **{**options, "prefix_checkpoints": n})
    except BudgetError as exc:
        running = options.get("max_running_requests") or ServeOptions().max_running_requests   # (the plan's default)
        return Trial(share=share, checkpoints=0, full_pages=0, hit_tokens=0, queried_tokens=0, running=running,
                     refused=str(exc))
    cache, sim = replay(p, requests, **sim_kwargs)
    s = cache.prefix.stats
    return Trial(share=share, checkpoints=n, full_pages=p.num_full_pages, hit_tokens=s.hit_tokens,
                 queried_tokens=s.queried_tokens, running=p.options.max_running_requests,
                 ttft_mean_s=sim.latency.summary()["all"]["ttft_s"]["mean"])

