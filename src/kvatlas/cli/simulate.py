"""`kvatlas simulate`: the `serve` workload, offline and as fast as possible (a virtual clock of
--step-ms per forward pass), then a PNG of memory by pool and measure over time, and a CSV."""

from __future__ import annotations

import argparse
import os
import time

from ..errors import ConfigError
from ..observing.progress import Bar, wanted
from .common import (FIT, add_deployment_args, add_fit_running_args, check_fit_running_args, check_output_file, count,
                     number, options_from_args, plan_from_args)
from .drive import (add_drive_args, build, check_record_served, host_memory, prepare, record_served,
                    replay_options, summary, write_served)
from .ranks import RANK_CHILD_ENV


def add_parser(p) -> None:
    add_deployment_args(p)
    add_drive_args(p)
    g = p.add_argument_group("output")
    g.add_argument("--sample-ms", type=number(0.0, 3.6e9), default=None,
                   help="a timeline point at most every this many ms of virtual time "
                        "(default: 1/2000 of the workload's span)")
    g.add_argument("--out", default="kvatlas-sim", help="output prefix: writes PREFIX.png, PREFIX.csv (memory "
                   "per pass) and PREFIX.requests.csv (latency per request) (default kvatlas-sim)")
    g.add_argument("--no-plot", action="store_true", help="write the CSV only")
    g.add_argument("--record-served", action="store_true",
                   help="also write PREFIX.served.jsonl: what the prefix cache served, as a trace that --workload "
                        "replays with the same sharing (each page key the id of its tokens) and --prefix-checkpoints "
                        "fit fits to (needs the prefix cache)")
    g.add_argument("--max-steps", type=count(1), default=None, help="stop after this many forward passes")
    add_fit_running_args(p, "--prefix-checkpoints fit")
    p.add_argument("--ranks", type=count(1, 64), default=1, help="run N rank processes, requests dealt round-robin, "
                   "each writing PREFIX.rankR.*, sharing --shared-tier (mooncake:// or redis://) (default 1)")
    if os.environ.get(RANK_CHILD_ENV) == "1":   # a rank process simulate --ranks started: only it takes these
        p.add_argument("--rank", type=count(0, 63), required=True, help=argparse.SUPPRESS)
        p.add_argument("--ranks-of", type=count(2, 64), required=True, help=argparse.SUPPRESS)


def run(args) -> int:
    if not args.out or args.out.endswith(os.sep) or os.path.isdir(args.out):
        raise ConfigError("--out", f"{args.out!r} is not a file prefix", "give a prefix such as runs/sim1")
    for prefix in ([args.out] if args.ranks == 1 else [f"{args.out}.rank{r}" for r in range(args.ranks)]):
        for path in output_paths(prefix, args):   # every file the run writes, before the run
            check_output_file("--out", path, extensions=None)
    if args.prefix_checkpoints == FIT and (args.ranks > 1 or args.ranks_of > 1):
        raise ConfigError("--prefix-checkpoints", "fit with --ranks (each rank would fit to its share of the "
                          "workload)", "fit on one rank first, then give every rank the count it prints")
    slack = check_fit_running_args(args, args.prefix_checkpoints == FIT, "--prefix-checkpoints fit")
    if args.record_served:
        check_record_served(args, "--record-served", None)   # (the file: output_paths, above)
    if args.record_served and (args.ranks > 1 or args.ranks_of > 1):
        raise ConfigError("--record-served", "with --ranks (each rank serves its share of the workload)",
                          "record a run of one rank")
    if args.ranks > 1 and args.ranks_of > 1:
        raise ConfigError("--ranks", "given to a rank process", "drop --ranks")
    if args.ranks > 1:
        from .ranks import run_ranks
        return run_ranks(args, prepare)   # drive's checks, passed down: drive imports ranks (deal)
    fitted = fit_from_args(args, slack) if args.prefix_checkpoints == FIT else None
    cache, sim, writer = build(args, plan_from_args, prepared=fitted)
    if args.record_served:   # on the simulator's virtual clock, every request it was given
        record_served(cache, sim, len(sim.unarrived()))
    t0 = time.perf_counter()
    total = len(sim.pending)
    with Bar(total, "simulate", wanted(), unit="requests") as bar:
        sim.run_offline(max_steps=args.max_steps,
                        on_step=lambda s: bar.update(s.stats.finished + s.stats.rejected_too_long))
    wall = time.perf_counter() - t0
    if sim.done:
        cache.check_integrity()
    from ..observing.timeline_plot import write_csv, write_png
    csv_path, png_path = f"{args.out}.csv", f"{args.out}.png"
    write_csv(csv_path, sim.timeline)
    written = [csv_path, write_requests(args.out, sim)]
    if args.record_served:
        written.append(write_served(cache, f"{args.out}.served.jsonl"))
    if not args.no_plot:
        write_png(png_path, sim.timeline, title=f"kvatlas simulate — {cache.plan.model.name}")
        written.append(png_path)
    virtual = sim.timeline[-1].t_s if sim.timeline else 0.0
    print(summary(cache, sim, writer, wall, f"offline; {virtual:.1f} s of virtual time"))
    if args.ranks_of > 1:
        from .ranks import write_rank_result
        written.append(write_rank_result(args, cache, sim))
    print("\nwritten: " + ", ".join(written))
    return 0


def fit_from_args(args, slack: float):
    """--prefix-checkpoints fit: every other argument checked first (with a provisional count),
    then the workload replayed at each candidate share (kvatlas.driving.fit), the table printed,
    and the run prepared with the count that hit most."""
    from dataclasses import replace

    from ..driving.fit import SHARES, checkpoints_for_share, default_jobs, fit_checkpoints
    running = args.fit_running
    if running is not None:
        args.max_running_requests = running[0]   # provisional, as the count below: the fewest
    opts = options_from_args(args, prefix_checkpoints=0)
    model = args.model
    args.prefix_checkpoints = checkpoints_for_share(model, SHARES[0], **opts)   # provisional: the checks below
    pr = prepare(args, plan_from_args)
    if running is not None:
        opts.pop("max_running_requests")   # (fitted among those counts)
    jobs = default_jobs()
    print(f"fitting --prefix-checkpoints: the {len(pr.requests):,} requests replayed at shares "
          f"{', '.join(f'{s:g}' for s in SHARES)} of the budget, then around the best"
          + (f", at {', '.join(map(str, running))} running requests each (the count: the most hits within "
             f"{slack:.0%} of the lowest mean TTFT)" if running else "")
          + f" (bookkeeping only; {jobs} replays at once)", flush=True)
    t0 = time.perf_counter()
    sim = replay_options(args, pr.time_model)

    def progress(t) -> None:
        print((f"  {t.running} running," if running else " ") + f" share {t.share:g}: "
              + ("does not fit the budget" if t.refused else f"{t.checkpoints:,} resume points, hit {t.hit_ratio:.2%}")
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    fit = fit_checkpoints(model, pr.requests, simulator=sim, jobs=jobs, running=running, ttft_slack=slack,
                          progress=progress, **opts)
    print(fit.table())
    args.prefix_checkpoints = fit.best.checkpoints
    if running:
        args.max_running_requests = fit.best.running
        print(f"fitted: --max-running-requests {fit.best.running} (mean TTFT {fit.best.ttft_mean_s:.2f} s)", flush=True)
    print(f"fitted: --prefix-checkpoints {fit.best.checkpoints} ({fit.best.share:g} of the budget); the run "
          "below uses it\n", flush=True)
    p = plan_from_args(args)
    return replace(pr, plan=p, host_bytes=host_memory(args, p))


def output_paths(prefix: str, args) -> list[str]:
    """Every file a run with this prefix writes."""
    paths = [f"{prefix}.csv", f"{prefix}.requests.csv"]
    if not args.no_plot:
        paths.append(f"{prefix}.png")
    if args.ranks_of > 1 or args.ranks > 1:
        paths.append(f"{prefix}.json")
    if args.record_served:
        paths.append(f"{prefix}.served.jsonl")
    return paths


def write_requests(prefix: str, sim) -> str:
    """PREFIX.requests.csv: one row per request of the workload, those never admitted too."""
    from ..driving.latency import write_requests_csv
    path = f"{prefix}.requests.csv"
    write_requests_csv(path, sim.latency.timings(sim.unarrived()))
    return path
