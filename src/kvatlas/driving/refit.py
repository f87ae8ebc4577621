"""The resume-point count fitted again while the cache serves.

How many resume points a plan holds is fitted by replaying a workload (kvatlas.driving.fit), and
the pools are fixed once allocated. A running cache that records what it serves
(`PrefixCache.record`) can be fitted on that, again and again as its traffic moves: every `every`
requests it has served, the latest it recorded are replayed at each candidate share, beside the
count it runs with now, in a process of its own (the serving loop never waits on a fit; a spawned
process, so a cache on a GPU is never forked). `state()` says what the latest fit found: the count
the next start should hold, and what the count running now hits on the same requests.
"""

from __future__ import annotations

import time

from ..checks import real, whole
from ..errors import ConfigError
from .fit import SHARES, TTFT_SLACK, fit_checkpoints, points_for_share, running_counts, share_of_points
from .traces import served_requests


def fit_served(model, rows, kwargs: dict):
    """fit_checkpoints on the trace of served rows (kvatlas.prefix.record.Served), in the fitting
    process: the loop that serves only copies the rows' list."""
    return fit_checkpoints(model, served_requests(rows), **kwargs)


class Refit:
    """Fits for one cache (module doc). `options`: plan()'s for the fit, without
    prefix_checkpoints (the deployment the cache was planned with); `simulator`: the Simulator's
    keyword arguments of the replays; `running`: running counts to fit too (fit_checkpoints'
    `running`, the count running now among them; each slot's fixed state is budget), weighed
    with `ttft_slack`; `background=False` fits in the caller's thread (tests)."""

    def __init__(self, cache, model, options: dict, *, every: int, simulator: dict | None = None,
                 running=None, ttft_slack: float = TTFT_SLACK, background: bool = True) -> None:
        if cache.prefix is None or cache.prefix.served_total is None:
            raise ConfigError("cache", "records nothing to fit on",
                              "turn the prefix cache on and call cache.prefix.record() first")
        if options.get("prefix_checkpoints"):
            raise ConfigError("options", "prefix_checkpoints given to the fit that chooses it", "drop it")
        self.cache, self.model, self.options = cache, model, dict(options)
        self.every = whole("every", every, 1, 1 << 40)
        self.simulator = dict(simulator or {})
        self.background = bool(background)
        self.share_now = share_of_points(cache.plan)
        self.running_now = cache.plan.options.max_running_requests
        # the fit's shares, the running one among them (one that buys the same count is left out)
        now = cache.plan.options.prefix_checkpoints
        shares = {self.share_now, *(s for s in SHARES if points_for_share(cache.plan, s) != now)}
        self.fit_kwargs = {"shares": tuple(sorted(shares)), "simulator": self.simulator, "jobs": 1, **self.options}
        if running is not None:   # (the count running now is a candidate: what it hits is the baseline)
            counts = running_counts(running, {})
            self.fit_kwargs.pop("max_running_requests", None)
            self.fit_kwargs.update(running=tuple(sorted({*counts, self.running_now})),
                                   ttft_slack=real("ttft_slack", ttft_slack, 0.0, 1e6))
        self.latest: dict | None = None   # the latest fit's findings (state())
        self.error = ""
        self.fits = 0
        self._seen = 0                    # requests served when the latest fit began
        self._t0 = time.monotonic()
        self._pool = self._future = None
        self._pending: tuple | None = None   # (requests it fits on, when it began)

    def poll(self) -> None:
        """Between passes: take a fit that has ended; begin one where `every` more requests were
        served since the last began and none is under way."""
        if self._future is not None and self._future.ready():
            future, self._future = self._future, None
            try:
                self._took(future.get())
            except Exception as exc:   # noqa: BLE001 (a fit that fails is reported, never fatal)
                self.error = f"{type(exc).__name__}: {exc}"
        served = self.cache.prefix.served_total
        if self._future is None and served - self._seen >= self.every:
            self._seen = served
            rows = self.cache.prefix.served()   # (a copy of the list: the rows are made into a trace, and
            self._pending = (len(rows), time.monotonic() - self._t0)   # sent, off the loop's thread)
            args = (self.model, rows, self.fit_kwargs)
            if not self.background:
                self._took(fit_served(*args))
                return
            if self._pool is None:
                import multiprocessing as mp
                self._pool = mp.get_context("spawn").Pool(1)
            self._future = self._pool.apply_async(fit_served, args)

    def _took(self, fit) -> None:
        n, began = self._pending
        now = next(t for t in fit.trials if t.share == self.share_now and t.running == self.running_now)
        self.fits += 1
        self.error = ""
        self.latest = {"requests": n, "began_s": round(began, 3), "ended_s": round(time.monotonic() - self._t0, 3),
                       "checkpoints": fit.best.checkpoints, "share": fit.best.share, "hit_ratio": fit.best.hit_ratio,
                       "max_running_requests": fit.best.running, "running_fitted": fit.running_fitted,
                       "running_checkpoints": self.cache.plan.options.prefix_checkpoints,
                       "running_max_running_requests": self.running_now, "running_hit_ratio": now.hit_ratio,
                       "fit": fit.to_dict(), "table": fit.table()}

    @property
    def busy(self) -> bool:
        return self._future is not None

    def state(self) -> dict:
        """For /state: the latest fit (None until one ended), whether one is under way, and the
        error of the last one that failed."""
        return {"every": self.every, "fits": self.fits, "fitting": self.busy, "latest": self.latest,
                **({"error": self.error} if self.error else {})}

    def line(self) -> str:
        """The latest fit in one line (the summary's)."""
        f = self.latest
        if f is None:
            return "none ended yet" + (" (one under way)" if self.busy else "")
        count = (f"--max-running-requests {f['max_running_requests']:,} " if f["running_fitted"] else "")
        now = (f"{f['running_max_running_requests']:,} running requests and " if f["running_fitted"] else "")
        return (f"on the latest {f['requests']:,} requests served ({f['ended_s']:.1f} s in): {count}--prefix-checkpoints "
                f"{f['checkpoints']:,} ({f['share']:g} of the budget) hits {f['hit_ratio']:.2%}; {now}the "
                f"{f['running_checkpoints']:,} resume points running now, {f['running_hit_ratio']:.2%}; it applies at "
                "the next start")

    def close(self) -> None:
        """Stop: a fit under way is abandoned (its process ended)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = self._future = None
