"""Prefix-cache hit ratio on the Mooncake synthetic trace: the kvatlas checkpoint policy beside
the two baselines (resume points at request ends and divergence points only; at every page
boundary), V4-Flash with default options, at several budgets, in one run.

Bookkeeping only: the allocator and the prefix cache of each plan, no pool tensors (hit ratios
are a property of the bookkeeping; a 120 GiB plan runs on a small CPU machine). Each plan keeps
`--checkpoint-share` of its budget for resume points (prefix_checkpoints); the rest holds the
pages of running requests and of the cache. The same plan serves every policy.

Requests run one after another, as in SPEC §8's calibration. Time model (the same for every
policy, used for the x axis of the plot): a prefill costs 1 unit per computed prompt token, a
decode pass 30 units per generated token. Page keys come from the trace's 512-token block hashes
(two pages per block; a block hash names its whole prefix, so keys stay chained). The hit ratio
is counted in 512-token blocks: hit tokens / 512 over the trace's blocks, so the unbounded-cache
ceiling is the trace's 63.96%.

    python bench/prefix_hit.py [--trace FILE] [--budgets 16,32,64,120] [--plot FILE.png] [--json FILE]
    python bench/prefix_hit.py --merge A.json B.json ... [--plot FILE.png]   (budgets run apart, one table)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import kvatlas
from kvatlas.alloc import Allocator
from kvatlas.driving.fit import checkpoints_for_share
from kvatlas.prefix import MISS_REASONS, PrefixCache

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic.jsonl"
POLICIES = ("ends", "every-page", "kvatlas")
DECODE_UNITS = 30


def load(path: Path) -> list[tuple[int, int, np.ndarray]]:
    out = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        blocks = np.asarray(r["hash_ids"], np.uint64)
        keys = np.stack((blocks * 2 + 1, blocks * 2 + 2), 1).ravel()   # two pages per 512-token block
        out.append((r["input_length"], r["output_length"], keys[: r["input_length"] // 256]))
    return out


def make_plan(gib: int, share: float, **options):
    """V4-Flash at `gib` GiB with resume points worth `share` of it (kvatlas.driving.fit's rule:
    the budget's share over a point's unit and SWA tail pages); `options`: plan()'s others."""
    n = checkpoints_for_share("deepseek-v4-flash", share, memory_bytes=gib << 30, **options)
    return kvatlas.plan("deepseek-v4-flash", gib << 30, prefix_checkpoints=n, **options)


def simulate(p, policy: str, trace, on_admit=None, reuse_weight: float | None = None) -> dict:
    """One policy through the trace; `on_admit(i, cached_tokens)`, if given, hears each request's hit.
    reuse_weight: the eviction's credit for pages read again (None: the library's default)."""
    a = Allocator(p)
    pc = PrefixCache(a, policy=policy, **({} if reuse_weight is None else {"reuse_weight": reuse_weight}))
    chunk = p.options.chunked_prefill_tokens
    clock, curve = 0, []
    t0 = time.perf_counter()
    for i, (prompt, out, keys) in enumerate(trace):
        rid = i
        adm = pc.admit(rid, prompt, out, page_keys=keys)
        done = adm.cached_tokens
        if on_admit is not None:
            on_admit(i, done)
        clock += prompt - done
        while done < prompt + out:   # decode written as chunks: the same pages and boundaries
            n = min(chunk, prompt + out - done)
            a.extend(rid, n)
            done += n
        clock += DECODE_UNITS * out
        pc.finish(rid)
        if i % 50 == 0 or i == len(trace) - 1:
            curve.append((clock, pc.stats.hit_tokens / 512))
    s = pc.stats
    return {"policy": policy, "hit_blocks": s.hit_tokens / 512, "missed_tokens": s.missed(),
            "evicted_pages": s.evicted_pages, "evicted_checkpoints": s.evicted_checkpoints,
            "checkpoints_kept": pc.tree.checkpoints, "seconds": time.perf_counter() - t0, "curve": curve}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--budgets", default="16,32,64,120")
    ap.add_argument("--checkpoint-share", type=float, default=0.25)
    ap.add_argument("--limit", type=int, default=0, help="first N requests only (0: all)")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default: all three)")
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--merge", type=Path, nargs="+", help="print and plot the results of earlier --json runs")
    args = ap.parse_args()
    if args.merge:
        docs = [json.loads(p.read_text()) for p in args.merge]
        results = sorted((r for d in docs for r in d["results"]), key=lambda r: r["budget_gib"])
        table(results, docs[0]["ceiling"])
        if args.plot:
            plot(results, docs[0]["blocks"], args.plot)
        return
    trace = load(args.trace)
    if args.limit:
        trace = trace[: args.limit]
    blocks = sum(-(-prompt // 512) for prompt, _, _ in trace)
    seen, ceiling = set(), 0
    for line in args.trace.read_text().splitlines()[: len(trace)]:
        h = json.loads(line)["hash_ids"]
        ceiling += sum(1 for x in h if x in seen)
        seen.update(h)
    results = []
    print(f"{len(trace)} requests, {blocks} blocks; unbounded-cache ceiling {ceiling / blocks:.2%}")
    print(f"{'budget':>7} {'checkpoints':>11} {'policy':>11} {'hit':>7} {'of ceiling':>10}  misses (share of queried tokens)")
    for gib in (int(x) for x in args.budgets.split(",")):
        p = make_plan(gib, args.checkpoint_share)
        for policy in args.policies.split(","):
            r = simulate(p, policy, trace)
            r.update(budget_gib=gib, prefix_checkpoints=p.options.prefix_checkpoints, hit_ratio=r["hit_blocks"] / blocks)
            results.append(r)
            q = sum(r["missed_tokens"].values()) + r["hit_blocks"] * 512
            why = ", ".join(f"{k} {v / q:.1%}" for k, v in r["missed_tokens"].items())
            print(f"{gib:>5}Gi {p.options.prefix_checkpoints:>11} {policy:>11} {r['hit_ratio']:>7.2%} "
                  f"{r['hit_ratio'] / (ceiling / blocks):>10.1%}  {why}  ({r['seconds']:.0f} s)", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"ceiling": ceiling / blocks, "blocks": blocks, "results": results}))
    if args.plot:
        plot(results, blocks, args.plot)


def table(results, ceiling: float) -> None:
    print(f"| budget | resume points | policy | hit ratio (blocks) | of ceiling {ceiling:.2%} | "
          + " | ".join(MISS_REASONS) + " |")
    print("|---|---|---|---|---|" + "---|" * len(MISS_REASONS))
    for r in results:
        q = sum(r["missed_tokens"].values()) + r["hit_blocks"] * 512
        why = " | ".join(f"{r['missed_tokens'][k] / q:.1%}" for k in MISS_REASONS)
        print(f"| {r['budget_gib']} GiB | {r['prefix_checkpoints']} | {r['policy']} | {r['hit_ratio']:.2%} | "
              f"{r['hit_ratio'] / ceiling:.1%} | {why} |")


def plot(results, blocks, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    budgets = sorted({r["budget_gib"] for r in results})
    fig, axes = plt.subplots(1, len(budgets), figsize=(4 * len(budgets), 3.2), sharey=True)
    for ax, gib in zip(np.atleast_1d(axes), budgets):
        for r in (r for r in results if r["budget_gib"] == gib):
            t, hit = zip(*r["curve"])
            ax.plot(t, np.array(hit) / blocks, label=f"{r['policy']} {r['hit_ratio']:.1%}")
        ax.set_title(f"{gib} GiB")
        ax.set_xlabel("time (prefill-token units)")
        ax.legend(fontsize=7)
    np.atleast_1d(axes)[0].set_ylabel("cumulative hit blocks / trace blocks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
