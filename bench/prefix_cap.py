"""The prefix cache under a physical cap (vmm `max_physical_bytes`), against the same cache with
no cap, on one scripted workload: what the cap costs in hits, and how refusals behave.

The workload (one seed, the same for every cap; tests/lifecycle.py's serve_shared_prompts, which
a vmm test runs too): up to 12 running tiny-v4 requests, each a 512-token system prompt out of
six and 64-1,099 tokens of its own, 1-59 tokens generated; a prefill in 256-token chunks, then
one token a step. A write refused for physical memory ends its request (an engine would preempt
it). The backing is the CPU stand-in driver (64 KiB chunks): a
plan of 256 MiB, capped below it.

Per cap: admissions, admissions refused (and of those, refused after `can_admit` said yes, and
refused after evicting units), writes refused (and after evicting units), prompt tokens hit,
and hits against the uncapped run. Before the change that checks eviction can make room first
(kvatlas.vmm.chunks.ChunkMap.fits_after), a refusal could empty the cache for nothing.

    python bench/prefix_cap.py [--caps 16,24,40] [--steps 1200] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import kvatlas
from kvatlas.errors import IntegrityError
from kvatlas.vmm import StandInDriver, VmmBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from lifecycle import serve_shared_prompts  # noqa: E402  (the same workload as the vmm test's)

CHUNK = 64 << 10


def run(cap_mib: int | None, steps: int, seed: int) -> dict:
    p = kvatlas.plan("tiny-v4", "256MiB", max_model_len=2048, max_running_requests=32, prefix_checkpoints=8,
                     chunked_prefill_tokens=256)
    backend = VmmBackend(StandInDriver(granularity=CHUNK), keep_empty_chunks=2, chunk_bytes=CHUNK,
                         max_physical_bytes=None if cap_mib is None else cap_mib << 20)
    cache = kvatlas.allocate(p, backend=backend)
    pc = cache.prefix
    out = dict.fromkeys(("admitted", "refused", "refused_after_yes", "refused_evicting", "write_refused",
                         "write_refused_evicting"), 0)

    def evicted():
        s = pc.stats
        return s.evicted_pages, s.evicted_checkpoints, s.checkpoints_dropped

    def admission(rid, yes, refusal, changed):
        if refusal is None:
            out["admitted"] += 1
        else:
            out["refused"] += 1
            out["refused_after_yes"] += yes
            out["refused_evicting"] += changed

    def write_refused(rid, refusal, changed):
        out["write_refused"] += 1
        out["write_refused_evicting"] += changed

    t0 = time.perf_counter()
    serve_shared_prompts(cache, steps, seed, evicted, admission, write_refused)
    try:
        cache.check_integrity()
        out["books"] = "exact"
    except IntegrityError as exc:   # (before aaf018f: a resume point's unit freed twice)
        out["books"] = f"broken ({str(exc).split(': ', 1)[1].split(';')[0]})"
    out.update(hit_tokens=pc.stats.hit_tokens, evicted_pages=pc.stats.evicted_pages,
               seconds=time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--caps", default="16,24,40", help="caps in MiB (the plan is 256 MiB)")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    base = run(None, args.steps, args.seed)
    print("| cap | admitted | refused (after a yes / after evicting) | writes refused (after evicting) "
          "| pages evicted | hit tokens | hits / no cap | books at the end |")
    print("|---|---|---|---|---|---|---|---|")
    for cap in [None] + [int(x) for x in args.caps.split(",")]:
        r = base if cap is None else run(cap, args.steps, args.seed)
        print(f"| {'none' if cap is None else f'{cap} MiB'} | {r['admitted']} | {r['refused']} "
              f"({r['refused_after_yes']} / {r['refused_evicting']}) | {r['write_refused']} "
              f"({r['write_refused_evicting']}) | {r['evicted_pages']} | {r['hit_tokens']:,} "
              f"| {r['hit_tokens'] / base['hit_tokens']:.3f} | {r['books']} |", flush=True)


if __name__ == "__main__":
    main()
