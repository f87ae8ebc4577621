"""How many resume points, fitted to what the cache served: a run on the trace records what it
served (`PrefixCache.record`), the fit replays the trace made of that (`served_requests`), and the
share it finds is set against the fit on the trace itself.

One concurrent run of the trace through the simulator at `--share`, recorded on the simulator's
virtual clock (arrivals are enqueued, and `Simulator.now_s` reads each request's arrival while it
joins the queue, so the served trace keeps the trace's arrivals), then `fit_checkpoints` on the
served trace and, with `--against-trace`, on the trace: both tables printed, with the same
simulator options (time model, admission window).

    python bench/served_fit.py --trace ../shared/traces/mooncake_synthetic.jsonl --budget 16 \
        [--share 0.25] [--admission-window 0] [--against-trace]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import kvatlas
from kvatlas.driving.fit import checkpoints_for_share, default_jobs, fit_checkpoints
from kvatlas.driving.sim import Simulator
from kvatlas.driving.timemodel import default_time_model
from kvatlas.driving.traces import read_trace, served_requests

MODEL = "deepseek-v4-flash"


def served_run(requests, gib: int, share: float, window: int):
    """The trace through the simulator at `share`, recorded; returns (hit ratio, served requests)."""
    opts = {"memory_bytes": gib << 30}
    p = kvatlas.plan(MODEL, prefix_checkpoints=checkpoints_for_share(MODEL, share, **opts), **opts)
    cache = kvatlas.allocate(p, backend="none")
    sim = Simulator(cache, requests, record=False, time_model=default_time_model(), admission_window=window)
    cache.prefix.record(max_requests=len(requests), clock=lambda: sim.now_s)   # (the virtual clock)
    sim.run_offline()
    cache.check_integrity()
    return cache.prefix.stats.hit_ratio, served_requests(cache.prefix.served())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--budget", type=int, default=16, help="GiB (default 16)")
    ap.add_argument("--share", type=float, default=0.25, help="resume points' share in the recorded run (default 0.25)")
    ap.add_argument("--admission-window", type=int, default=0)
    ap.add_argument("--against-trace", action="store_true", help="also fit on the trace itself")
    args = ap.parse_args()
    requests, bad = read_trace(str(args.trace))
    assert not bad, bad[:3]
    sim = {"time_model": default_time_model(), "admission_window": args.admission_window}
    hit, served = served_run(requests, args.budget, args.share, args.admission_window)
    print(f"{len(requests)} requests, {args.budget} GiB, window {args.admission_window}: the recorded run at share "
          f"{args.share} hit {hit:.2%}", flush=True)
    for name, workload in [("the served trace", served)] + ([("the trace itself", requests)] if args.against_trace else []):
        t0 = time.perf_counter()
        fit = fit_checkpoints(MODEL, workload, simulator=sim, memory_bytes=args.budget << 30,
                              jobs=default_jobs())
        print(f"fit on {name} ({time.perf_counter() - t0:.0f} s): share {fit.best.share} "
              f"({fit.best.checkpoints:,} points)\n{fit.table()}", flush=True)


if __name__ == "__main__":
    main()
