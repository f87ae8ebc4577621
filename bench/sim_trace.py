"""The whole Mooncake trace through `kvatlas simulate`'s bookkeeping cache (issue 12, item 6).

    PYTHONPATH=src python3 bench/sim_trace.py --trace mooncake_synthetic.jsonl [--memory 120GiB]

One run, three phases on the same requests:
  (a) token ids of every prompt (what a content-addressed cache would hash), timed, and the
      trace's unbounded-cache ceiling (driving.content.prefix_ceiling_blocks);
  (b) the simulator with the bookkeeping backend ("none"), a timeline sample at most every
      1/2000 of the trace's span (what `kvatlas simulate` does by default);
  (c) baseline: the same run with a full ledger snapshot on the timeline after every pass (what
      the simulator did before sampling).
Reports wall and CPU seconds, passes, virtual seconds and the ratios (c)/(b) and virtual/wall;
and the peak resident memory of the process, for a plan that no tensor of this machine could hold.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import kvatlas
from kvatlas.driving.content import prefix_ceiling_blocks
from kvatlas.driving.sim import Simulator
from kvatlas.driving.timemodel import default_time_model
from kvatlas.driving.traces import read_trace
from kvatlas.units import parse_bytes


def _timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def run_sim(plan, reqs, sample_s: float) -> dict:
    cache = kvatlas.allocate(plan, backend="none")
    sim = Simulator(cache, reqs, time_model=default_time_model(), sample_s=sample_s)
    stats, wall, cpu = _timed(sim.run_offline)
    snap = cache.check_integrity()
    assert sim.done and stats.finished == len(reqs) and snap.occupied_bytes == 0 and snap.tensor_bytes == 0
    return {"wall_s": wall, "cpu_s": cpu, "passes": stats.steps, "virtual_s": sim.clock_s,
            "timeline_points": len(sim.timeline), "prefill_tokens": stats.prefill_tokens,
            "decode_tokens": stats.decode_tokens, "peak_running": stats.peak_running,
            "peak_occupied_bytes": stats.peak_occupied_bytes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True, help="a Mooncake-format JSONL trace")
    ap.add_argument("--model", default="deepseek-v4-flash")
    ap.add_argument("--memory", default="120GiB")
    ap.add_argument("--no-baseline", action="store_true", help="skip phase (c)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    (reqs, problems), read_wall, _ = _timed(lambda: read_trace(args.trace))
    toks, tok_wall, tok_cpu = _timed(lambda: sum(len(r.token_ids()) for r in reqs))
    plan = kvatlas.plan(args.model, parse_bytes(args.memory, "--memory"))
    span = max(r.arrival_s for r in reqs)
    fast = run_sim(plan, reqs, span / 2000)
    base = None if args.no_baseline else run_sim(plan, reqs, 0.0)
    hit, blocks = prefix_ceiling_blocks(reqs)
    out = {"requests": len(reqs), "bad_lines": len(problems), "read_s": read_wall, "prompt_tokens": toks,
           "ceiling_hit_blocks": hit, "prompt_blocks": blocks,
           "token_ids_wall_s": tok_wall, "token_ids_cpu_s": tok_cpu, "plan_bytes": plan.total_bytes,
           "sampled": fast, "every_pass": base,
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    print(json.dumps(out, indent=1))
    print(f"\n{len(reqs)} requests, {toks:,} prompt tokens; token ids {tok_wall:.2f} s "
          f"({toks / tok_wall / 1e6:.0f} M tokens/s); unbounded-cache ceiling {hit:,} of {blocks:,} blocks "
          f"({100 * hit / blocks:.2f}%)", file=sys.stderr)
    print(f"simulate (sampled): {fast['wall_s']:.1f} s wall, {fast['cpu_s']:.1f} s CPU, {fast['passes']:,} passes, "
          f"{fast['virtual_s']:.0f} s virtual ({fast['virtual_s'] / fast['wall_s']:.0f}x real time)", file=sys.stderr)
    if base:
        print(f"baseline (snapshot every pass): {base['wall_s']:.1f} s wall, {base['cpu_s']:.1f} s CPU; "
              f"CPU ratio baseline/sampled {base['cpu_s'] / fast['cpu_s']:.2f}", file=sys.stderr)
    print(f"peak RSS {out['peak_rss_bytes'] / 2**20:.0f} MiB for a {plan.total_bytes / 2**30:.0f} GiB plan",
          file=sys.stderr)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
