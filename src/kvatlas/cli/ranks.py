"""`kvatlas simulate --ranks N`: N rank processes, one simulate each, over one shared store.

Requests are dealt round-robin in arrival order (request i to rank i mod N), as a content-blind
router (SGLang's DP attention, vLLM's DP balancer) deals them; a later turn whose previous turn
went to another rank arrives at its own arrival time. Each rank is this same command again
(`--rank R --ranks-of N`, output PREFIX.rankR.*), a separate process with its own cache and host
tier, all sharing `--shared-tier`; at the end the ranks' prefix-cache figures are added up.

The parent checks every argument (the plan, the workload, the tiers' sizes and URL, the device)
before it starts a rank, so a bad one is refused once, in one line. `--rank`/`--ranks-of` exist
only in a process started with RANK_CHILD_ENV set (the parent sets it). SIGTERM or SIGINT to the
parent stops every rank (by its PID) before the parent exits.

Not repeatable run to run, even with `--seed`: each rank runs its own virtual clock as fast as
its CPU allows, so which rank writes a shared entry first (and so which rank's later request
finds it) depends on the processes' wall-clock speed; the summary says so."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys

from ..errors import ConfigError

RANK_CHILD_ENV = "KVATLAS_RANK_CHILD"   # set by run_ranks in each rank's environment


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


def run_ranks(args, prepare) -> int:
    """`prepare`: drive.prepare, which checks every argument (passed in: drive imports this module)."""
    if args.shared_tier is None:
        raise ConfigError("--ranks", "N ranks with no store to share are N separate caches",
                          "add --shared-tier mooncake://... or redis://... (and --host-memory)")
    if args.shared_tier.startswith("memory://"):
        raise ConfigError("--shared-tier", "memory:// lives inside one process; the ranks are separate processes",
                          "give mooncake://... or redis://...")
    from .common import plan_from_args
    prepare(args, plan_from_args, defer_pipe=True)   # every argument, once, before any rank starts
    env = {**os.environ, RANK_CHILD_ENV: "1"}
    procs = []
    stopped = []

    def terminate_all():
        for p in procs:
            if p.poll() is None:
                p.terminate()

    def stop(signum, frame):
        stopped.append(signal.Signals(signum).name)
        terminate_all()
    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for r in range(args.ranks):
            if stopped:
                break
            procs.append(subprocess.Popen([sys.executable, "-m", "kvatlas", *_child_argv(args, r)], env=env))
            if stopped:   # the signal came while Popen ran: the rank it started was not in procs to be stopped
                terminate_all()
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:   # an error here (or a second signal) must not leave a rank running
            if p.poll() is None:
                p.kill()
                p.wait()
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if stopped:
        print(f"kvatlas simulate: stopped by {stopped[0]}; stopped {len(procs)} rank processes", file=sys.stderr)
        return 130 if stopped[0] == "SIGINT" else 143
    bad = next(((r, c) for r, c in enumerate(codes) if c), None)
    if bad is not None:
        r, c = bad
        how = f"was killed by {_signal_name(-c)}" if c < 0 else f"exited with {c}"
        print(f"kvatlas simulate: error: --ranks: rank {r} {how}; see its output above", file=sys.stderr)
        return 1
    rows = [json.load(open(f"{args.out}.rank{r}.json")) for r in range(args.ranks)]
    hit, queried = sum(r["hit_tokens"] for r in rows), sum(r["queried_tokens"] for r in rows)
    shared = sum(r["shared_hit_tokens"] for r in rows)
    print(f"\n{args.ranks} ranks together: prefix-cache hit {hit / max(queried, 1):.1%} ({hit:,} of {queried:,} "
          f"prompt tokens); served from the shared tier {shared:,} tokens; per rank: "
          + ", ".join(f"{r['rank']}: {r['hit_tokens'] / max(r['queried_tokens'], 1):.1%}" for r in rows)
          + "\n(not repeatable run to run, even with --seed: each rank runs its own virtual clock, so which rank "
            "writes a shared entry first depends on how fast each process runs)")
    return 0


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


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
