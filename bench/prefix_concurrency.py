"""Prefix-cache hit ratio with concurrency beside the sequential figure, on the Mooncake synthetic
trace, V4-Flash with default options, at several budgets, device only and with a host tier.

- sequential: requests one after another, nothing running beside them (bench/prefix_hit.py's
  kvatlas policy, the same plans);
- concurrent: the trace's own arrival times through the simulator's continuous-batching driver
  (kvatlas.driving.sim: admissions between passes, chunked prefill of several requests in one
  pass, batched decode, finishes in the middle of others' prefill, eviction to admit), on its
  virtual clock under the default time model (20 ms + 40 µs per prefill token + 100 µs per decode
  token per pass); with --check-integrity every book is recounted after every pass.

Bookkeeping only (backend none: allocator, ledger and prefix cache, no pool tensors); the host
tier, when on, is the modeled one (the same slots and LRU, no memory). Each plan keeps
--checkpoint-share of its budget for resume points. Hit ratio in 512-token blocks (hit tokens /
512 over the trace's blocks), as in prefix_hit.py; the unbounded-cache ceiling is 63.96%.

    python bench/prefix_concurrency.py [--trace FILE] [--budgets 16,32,64,120] [--host-memory 128GiB]
                                       [--modes sequential,concurrent] [--check-integrity] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import prefix_hit

import kvatlas
from kvatlas.driving.sim import Simulator
from kvatlas.driving.timemodel import default_time_model
from kvatlas.driving.traces import read_trace
from kvatlas.tiers import HostLink
from kvatlas.tiers.modeled import ModeledHost
from kvatlas.units import parse_bytes


def concurrent(p, requests, host_bytes: int | None, check: bool) -> dict:
    cache = kvatlas.allocate(p, backend="none")
    host = None
    if host_bytes:
        host = cache.host = HostLink(cache.prefix, ModeledHost(p, host_bytes))
    sim = Simulator(cache, requests, record=False, host=host, check_integrity=check, time_model=default_time_model())
    t0 = time.perf_counter()
    sim.run_offline()
    cache.check_integrity()
    s = cache.prefix.stats
    assert s.queried_tokens == s.hit_tokens + sum(s.missed().values()), "queried != hit + missed"
    out = {"hit_tokens": s.hit_tokens, "queried_tokens": s.queried_tokens, "missed_tokens": s.missed(),
           "evicted_pages": s.evicted_pages, "evicted_checkpoints": s.evicted_checkpoints,
           "passes": sim.stats.steps, "peak_running": sim.stats.peak_running, "virtual_s": sim.clock_s,
           "seconds": time.perf_counter() - t0}
    if host is not None:
        out["host_hit_tokens"] = s.host_hit_tokens
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=prefix_hit.TRACE)
    ap.add_argument("--budgets", default="16,32,64,120")
    ap.add_argument("--checkpoint-share", type=float, default=0.25)
    ap.add_argument("--host-memory", default=None, help="also run with a modeled host tier of this size")
    ap.add_argument("--modes", default="sequential,concurrent")
    ap.add_argument("--check-integrity", action="store_true", help="recount every book after every pass")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    trace = prefix_hit.load(args.trace)
    requests, bad = read_trace(str(args.trace))
    assert not bad and len(requests) == len(trace)
    blocks = sum(-(-prompt // 512) for prompt, _, _ in trace)
    hosts = [None] + ([parse_bytes(args.host_memory, "--host-memory")] if args.host_memory else [])
    modes = args.modes.split(",")
    print(f"{len(trace)} requests, {blocks} blocks")
    print(f"{'budget':>7} {'resume pts':>10} {'host':>8} {'mode':>11} {'hit':>7}  misses (share of queried tokens)")
    results = []
    for gib in (int(x) for x in args.budgets.split(",")):
        p = prefix_hit.make_plan(gib, args.checkpoint_share)
        for host in hosts:
            for mode in modes:
                if mode == "sequential":
                    if host:
                        continue   # the sequential bench has no host tier
                    r = prefix_hit.simulate(p, "kvatlas", trace)
                    r["hit_tokens"] = r["hit_blocks"] * 512
                    r["queried_tokens"] = r["hit_tokens"] + sum(r["missed_tokens"].values())
                else:
                    r = concurrent(p, requests, host, args.check_integrity)
                r.pop("curve", None)
                r.update(budget_gib=gib, mode=mode, host_bytes=host or 0,
                         prefix_checkpoints=p.options.prefix_checkpoints, hit_ratio=r["hit_tokens"] / 512 / blocks)
                results.append(r)
                why = ", ".join(f"{k} {v / r['queried_tokens']:.1%}" for k, v in r["missed_tokens"].items())
                extra = f", {r['passes']} passes, peak running {r['peak_running']}" if "passes" in r else ""
                print(f"{gib:>5}Gi {p.options.prefix_checkpoints:>10} {(host or 0) >> 30:>6}Gi {mode:>11} "
                      f"{r['hit_ratio']:>7.2%}  {why}  ({r['seconds']:.0f} s{extra})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"blocks": blocks, "results": results}))


if __name__ == "__main__":
    main()
