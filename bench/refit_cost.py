"""What fitting the count again while serving costs the serving loop (`Refit`, `serve
--refit-every`): the trace through the simulator (bookkeeping only, as fast as it goes), recorded,
once without a refit and once with one polled between passes, every `--every` requests served,
the fits in a spawned process. The two runs take turns `--repeats` times; each figure is the
run with the refit against the run without, in the same repeat.

Printed: the loop's wall time with / without; of it, the seconds `poll` held the loop (making the
served trace and handing it to the process, at each fit begun), per fit begun; fits begun and
ended within the run; and that the runs served the same (the hits are equal: the refit reads,
never changes, the cache).

    python bench/refit_cost.py --trace ../shared/traces/mooncake_synthetic.jsonl --budget 16 \
        [--every 2000] [--share 0.15] [--admission-window 4096] [--repeats 2] [--running 32,64,128]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import kvatlas
from kvatlas.driving.fit import checkpoints_for_share
from kvatlas.driving.refit import Refit
from kvatlas.driving.sim import Simulator
from kvatlas.driving.timemodel import default_time_model
from kvatlas.driving.traces import read_trace

MODEL = "deepseek-v4-flash"


def run(requests, gib: int, share: float, window: int, every: int | None, running=None, slack=None):
    """(wall s, s in poll, fits begun, fits ended, hit ratio, the last fit's seconds, its findings)
    of one run; every None: no refit."""
    opts = {"memory_bytes": gib << 30}
    p = kvatlas.plan(MODEL, prefix_checkpoints=checkpoints_for_share(MODEL, share, **opts), **opts)
    cache = kvatlas.allocate(p, backend="none")
    tm = default_time_model()
    sim = Simulator(cache, requests, record=False, time_model=tm, admission_window=window)
    cache.prefix.record(max_requests=len(requests), clock=lambda: sim.now_s)
    refit = None if every is None else Refit(cache, MODEL, opts, every=every, running=running,
                                             simulator={"time_model": tm, "admission_window": window},
                                             **({} if slack is None else {"ttft_slack": slack}))
    held, begun = [0.0], [0]

    def poll(_) -> None:
        t = time.perf_counter()
        busy = refit.busy
        refit.poll()
        begun[0] += refit.busy and not busy
        held[0] += time.perf_counter() - t

    t0 = time.perf_counter()
    sim.run_offline(on_step=poll if refit is not None else None)
    wall = time.perf_counter() - t0
    ended = refit.fits if refit is not None else 0
    fit_s = 0.0
    if refit is not None:   # (after the loop, not timed with it: how long the fit under way takes)
        while refit.busy:
            time.sleep(0.5)
            refit.poll()
        fit_s = refit.latest["ended_s"] - refit.latest["began_s"]
        refit.close()
    return wall, held[0], begun[0], ended, cache.prefix.stats.hit_ratio, fit_s, refit.latest if refit else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--budget", type=int, default=16, help="GiB")
    ap.add_argument("--share", type=float, default=0.15)
    ap.add_argument("--every", type=int, default=2000)
    ap.add_argument("--admission-window", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--running", default=None, help="N,N,...: the refit fits the running count too (Refit(running=))")
    ap.add_argument("--ttft-slack", type=float, default=None)
    args = ap.parse_args()
    requests, _ = read_trace(str(Path(args.trace)))
    print(f"{len(requests):,} requests, {args.budget} GiB, share {args.share:g}, window {args.admission_window}, "
          f"a fit every {args.every:,} served")
    for i in range(args.repeats):
        off = run(requests, args.budget, args.share, args.admission_window, None)
        on = run(requests, args.budget, args.share, args.admission_window, args.every,
                 None if args.running is None else [int(n) for n in args.running.split(",")], args.ttft_slack)
        assert on[4] == off[4], (on[4], off[4])   # the same hits: the refit never changes the cache
        print(f"repeat {i + 1}: wall {on[0]:.1f} s with the refit / {off[0]:.1f} s without = {on[0] / off[0]:.3f}x; "
              f"poll held the loop {on[1]:.2f} s in all, {on[1] / max(on[2], 1) * 1e3:.0f} ms a fit begun "
              f"({on[2]} begun, {on[3]} ended within the run); hit {on[4]:.2%} both; the last fit took {on[5]:.0f} s "
              f"on {on[6]['requests']:,} requests: --prefix-checkpoints {on[6]['checkpoints']:,} "
              f"({on[6]['share']:g}) hits {on[6]['hit_ratio']:.2%} of them, the running "
              f"{on[6]['running_checkpoints']:,} {on[6]['running_hit_ratio']:.2%}"
              + (f"; fitted running count {on[6]['max_running_requests']} (running now "
                 f"{on[6]['running_max_running_requests']})\n{on[6]['table']}" if on[6]["running_fitted"] else ""),
              flush=True)


if __name__ == "__main__":
    main()
