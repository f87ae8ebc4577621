"""`kvatlas simulate --ranks N`: N rank processes, one simulate each, over one shared store.

Requests are dealt round-robin in arrival order (request i to rank i mod N), as a content-blind
router (SGLang's DP attention, vLLM's DP balancer) deals them; a later turn whose previous turn
went to another rank arrives at its own arrival time. Each rank is this same command again
(`--rank R --ranks-of N`, output PREFIX.rankR.*), a separate process with its own cache and host
tier, all sharing `--shared-tier`; at the end the ranks' prefix-cache figures are added up."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

from ..errors import ConfigError


def deal(requests, rank: int, n: int) -> list:
    mine = sorted(requests, key=lambda r: r.arrival_s)[rank::n]
    ids = {r.id for r in mine}
    return [r if r.after is None or r.after in ids else dataclasses.replace(r, after=None) for r in mine]


def _child_argv(args, rank: int) -> list[str]:
    argv, skip = [], False
    for a in args.argv[1:]:
        if skip:
            skip = False
            continue
        if a in ("--ranks", "--out"):
            skip = True
            continue
        if a.startswith(("--ranks=", "--out=")):
            continue
        argv.append(a)
    return ["simulate", *argv, "--out", f"{args.out}.rank{rank}", "--rank", str(rank), "--ranks-of", str(args.ranks)]


def run_ranks(args) -> int:
    if args.shared_tier is None:
        raise ConfigError("--ranks", "N ranks with no store to share are N separate caches",
                          "add --shared-tier mooncake://... or redis://... (and --host-memory)")
    if args.shared_tier.startswith("memory://"):
        raise ConfigError("--shared-tier", "memory:// lives inside one process; the ranks are separate processes",
                          "give mooncake://... or redis://...")
    procs = [subprocess.Popen([sys.executable, "-m", "kvatlas", *_child_argv(args, r)]) for r in range(args.ranks)]
    codes = [p.wait() for p in procs]
    if any(codes):
        print(f"kvatlas simulate: error: --ranks: rank {codes.index(next(c for c in codes if c))} exited with "
              f"{next(c for c in codes if c)}; see its output above", file=sys.stderr)
        return 1
    rows = [json.load(open(f"{args.out}.rank{r}.json")) for r in range(args.ranks)]
    hit, queried = sum(r["hit_tokens"] for r in rows), sum(r["queried_tokens"] for r in rows)
    shared = sum(r["shared_hit_tokens"] for r in rows)
    print(f"\n{args.ranks} ranks together: prefix-cache hit {hit / max(queried, 1):.1%} ({hit:,} of {queried:,} "
          f"prompt tokens); served from the shared tier {shared:,} tokens; per rank: "
          + ", ".join(f"{r['rank']}: {r['hit_tokens'] / max(r['queried_tokens'], 1):.1%}" for r in rows))
    return 0


def write_rank_result(args, cache, sim) -> str:
    """PREFIX.json: this rank's figures, for the parent to add up."""
    s = cache.prefix.stats if cache.prefix is not None else None
    shared = sim.host.shared_snapshot() if sim.host is not None else None
    path = f"{args.out}.json"
    with open(path, "w") as f:
        json.dump({"rank": args.rank, "hit_tokens": s.hit_tokens if s else 0, "queried_tokens": s.queried_tokens if s else 0,
                   "shared_hit_tokens": shared.hit_tokens if shared else 0,
                   "shared_tier": shared.to_dict() if shared else None}, f)
    return path
