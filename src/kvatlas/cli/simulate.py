"""`kvatlas simulate`: the `serve` workload, offline and as fast as possible (a virtual clock of
--step-ms per forward pass), then a PNG of memory by pool and measure over time, and a CSV."""

from __future__ import annotations

import os
import time

from ..errors import ConfigError
from .common import add_deployment_args, plan_from_args
from .drive import add_workload_args, build, summary


def add_parser(p) -> None:
    add_deployment_args(p)
    add_workload_args(p)
    g = p.add_argument_group("output")
    g.add_argument("--out", default="kvatlas-sim", help="output prefix: writes PREFIX.png and PREFIX.csv "
                   "(default kvatlas-sim)")
    g.add_argument("--no-plot", action="store_true", help="write the CSV only")
    g.add_argument("--max-steps", type=int, default=None, help="stop after this many forward passes")


def run(args) -> int:
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise ConfigError("--out", f"directory {out_dir!r} does not exist", "create it or give another prefix")
    cache, sim, writer = build(args, plan_from_args)
    t0 = time.perf_counter()
    sim.run_offline(max_steps=args.max_steps)
    wall = time.perf_counter() - t0
    if sim.done:
        cache.check_integrity()
    from ..observing.timeline_plot import write_csv, write_png
    csv_path, png_path = f"{args.out}.csv", f"{args.out}.png"
    write_csv(csv_path, sim.timeline)
    written = [csv_path]
    if not args.no_plot:
        write_png(png_path, sim.timeline, title=f"kvatlas simulate — {cache.plan.model.name}")
        written.append(png_path)
    virtual = sim.timeline[-1].t_s if sim.timeline else 0.0
    print(summary(cache, sim, writer, wall, f"offline; {virtual:.1f} s of virtual time"))
    print("\nwritten: " + ", ".join(written))
    return 0
