"""Prefix-cache hit ratio on the Mooncake synthetic trace with a host tier under the device pools:
32 GiB of device KV plus 128 GiB of host tier, beside the device-only 32 GiB and 120 GiB runs of
the prefix-cache benchmark (bench/prefix_hit.py: same trace loading, same plans, same kvatlas
checkpoint policy, requests one after another), in one table from one run.

Bookkeeping only, like prefix_hit.py: the allocator and the prefix cache of each plan and a
`ModeledHost` (kvatlas.tiers.modeled: host slots, host LRU, no memory) under it. Every eviction
moves the page or resume point to the host tier; before each admission the prompt's host-resident
pages and resume point are brought back (HostLink.prefetch), as a serving engine would before
the request's first forward pass. Transfer time comes from the H200 measurements
(kvatlas.tiers.modeled.move_seconds) and is reported beside the hit ratio; it does not change
which blocks hit.

    python bench/host_tier_mooncake.py [--trace FILE] [--limit N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefix_hit import TRACE, load, make_plan  # noqa: E402

from kvatlas.alloc import Allocator  # noqa: E402
from kvatlas.prefix import PrefixCache  # noqa: E402
from kvatlas.tiers import HostLink  # noqa: E402
from kvatlas.tiers.modeled import ModeledHost  # noqa: E402

RUNS = ((32, None), (120, None), (32, 128))   # (device GiB, host GiB)


def run(trace, device_gib: int, host_gib: int | None, share: float, host_share: float) -> dict:
    p = make_plan(device_gib, share)
    a = Allocator(p)
    pc = PrefixCache(a, policy="kvatlas")
    link = HostLink(pc, ModeledHost(p, host_gib << 30, host_share)) if host_gib else None
    chunk = p.options.chunked_prefill_tokens
    t0 = time.perf_counter()
    for rid, (prompt, out, keys) in enumerate(trace):
        if link is not None:
            link.prefetch(prompt, page_keys=keys)
        adm = pc.admit(rid, prompt, out, page_keys=keys)
        done = adm.cached_tokens
        while done < prompt + out:
            n = min(chunk, prompt + out - done)
            a.extend(rid, n)
            done += n
        pc.finish(rid)
    r = {"device_gib": device_gib, "host_gib": host_gib or 0, "hit_tokens": pc.stats.hit_tokens,
         "evicted_pages": pc.stats.evicted_pages, "missed_tokens": pc.stats.missed(),
         "seconds": time.perf_counter() - t0}
    if link is not None:
        snap = link.snapshot()
        r.update(host_hit_tokens=snap.hits["host_hit_tokens"], host_hits=snap.hits,
                 moved_to_host=snap.moved_to_host, moved_to_device=snap.moved_to_device,
                 host_evictions=snap.evicted, bytes_to_device=snap.bytes_to_device,
                 bytes_to_host=snap.bytes_to_host, modeled_seconds=link.tier.modeled_seconds,
                 host_pages=link.tier.plan.num_pages, host_checkpoints=link.tier.plan.num_checkpoints)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--checkpoint-share", type=float, default=0.25)
    ap.add_argument("--host-checkpoint-shares", default="0.33,0.6",
                    help="host tier: share of its bytes for resume points, one 32+128 run per value")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    trace = load(args.trace)
    if args.limit:
        trace = trace[: args.limit]
    blocks = sum(-(-prompt // 512) for prompt, _, _ in trace)
    print(f"{len(trace)} requests, {blocks} blocks")
    print(f"{'device':>7} {'host':>6} {'host ckpt share':>15} {'hit':>7} {'from host':>9} {'restored':>18} "
          f"{'modeled restore s':>17}")
    rows = []
    shares = [float(x) for x in args.host_checkpoint_shares.split(",")]
    runs = [(d, h, 0.0) for d, h in RUNS if not h] + [(d, h, s) for d, h in RUNS if h for s in shares]
    for dev, host, host_share in runs:
        r = run(trace, dev, host, args.checkpoint_share, host_share)
        r["host_checkpoint_share"] = host_share
        r["hit_ratio"] = r["hit_tokens"] / 512 / blocks
        rows.append(r)
        from_host = r.get("host_hit_tokens", 0) / 512 / blocks
        restored = (f"{r['moved_to_device']['pages']} pg, {r['moved_to_device']['checkpoints']} ck"
                    if host else "-")
        secs = f"{r['modeled_seconds']['device']:.1f}" if host else "-"
        print(f"{dev:>5}Gi {(str(host) + 'Gi') if host else '-':>6} {host_share if host else '-':>15} "
              f"{r['hit_ratio']:>7.2%} {from_host:>9.2%} "
              f"{restored:>18} {secs:>17}  ({r['seconds']:.0f} s)", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"blocks": blocks, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
