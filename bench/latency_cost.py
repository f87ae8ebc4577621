"""What per-request latency and the limit log cost the simulator: the whole trace through the
bookkeeping cache with them (as `kvatlas simulate` runs) against the same run with their hooks
made no-ops, alternated A/B/A/B in one process.

    PYTHONPATH=src python3 bench/latency_cost.py --trace mooncake_synthetic.jsonl [--memory 120GiB] [--rounds 2]

Reports CPU seconds of each run and the ratio with/without (the median over rounds); the two
kinds of run must agree on every pass and token count.
"""

from __future__ import annotations

import argparse
import statistics
import time

import kvatlas
from kvatlas.driving.latency import LatencyLog
from kvatlas.driving.limits import LimitLog
from kvatlas.driving.sim import Simulator
from kvatlas.driving.timemodel import default_time_model
from kvatlas.driving.traces import read_trace
from kvatlas.units import parse_bytes


class _NoLatency(LatencyLog):
    def arrived(self, req, t_s): pass
    def rejected(self, req): pass
    def admitted(self, req, t_s, cached_tokens): pass
    def prefilled(self, req): pass
    def decoded(self, req, before, after): pass
    def pass_ended(self, end_s): pass


class _NoLimits(LimitLog):
    def blocked(self, cache, running, max_running): pass
    def pass_done(self, new_tokens, budget): pass


def run(plan, reqs, span_s: float, logs: bool) -> tuple[float, tuple]:
    cache = kvatlas.allocate(plan, backend="none")
    sim = Simulator(cache, reqs, time_model=default_time_model(), sample_s=span_s / 2000)
    if not logs:
        sim.latency, sim.limits = _NoLatency(), _NoLimits()
    c = time.process_time()
    stats = sim.run_offline()
    cpu = time.process_time() - c
    if logs:   # what the summary computes from them, inside the timed run's cost
        c2 = time.process_time()
        sim.latency.summary()
        cpu += time.process_time() - c2
    assert sim.done and stats.finished == len(reqs)
    return cpu, (stats.steps, stats.prefill_tokens, stats.decode_tokens)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--model", default="deepseek-v4-flash")
    ap.add_argument("--memory", default="120GiB")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    reqs, _ = read_trace(args.trace)
    plan = kvatlas.plan(args.model, parse_bytes(args.memory, "--memory"))
    span = max(r.arrival_s for r in reqs)
    ratios = []
    for i in range(args.rounds):
        with_cpu, a = run(plan, reqs, span, True)
        without_cpu, b = run(plan, reqs, span, False)
        assert a == b, (a, b)
        ratios.append(with_cpu / without_cpu)
        print(f"round {i + 1}: with latency {with_cpu:.2f} s CPU, without {without_cpu:.2f} s; "
              f"ratio {ratios[-1]:.3f} ({a[0]:,} passes)")
    print(f"{len(reqs)} requests: with / without, median of {args.rounds}: {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
