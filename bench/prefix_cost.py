"""What the prefix cache costs, each figure a ratio measured in one run:

1. Matching and admitting a 128K-token prompt whose pages are all cached (keys from its token
   ids, the tree walk, the admission with 511 shared pages and a resume point) against hashing
   its token ids alone (`page_keys`). Target: ≤ 3×.
2. The decode step of bench/alloc_step.py (1,024 running requests, +1 token each) with the
   prefix cache on against the same step with it off. With it on, a step finds its resume rows
   (units taken ahead), and every 32 tokens an upkeep makes the captures due, decides them and
   takes units for the next tails. So steps are timed in blocks of two whole upkeep cycles (64
   steps), off and on blocks interleaved; a block's mean is its per-step cost, and the figure is
   the median over blocks (a median over single steps would leave the upkeep out). Target: ≤ 1.10×.

    python bench/prefix_cost.py [--requests 1024] [--steps 1280] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import kvatlas
from kvatlas.alloc import Allocator
from kvatlas.cache.ledger import Ledger
from kvatlas.prefix import PrefixCache, page_keys

sys.path.insert(0, str(Path(__file__).resolve().parent))
from alloc_step import _NoArena  # noqa: E402  (the same ledger stand-in as the step benchmark)

PROMPT = 131072


def admit_cost(repeats: int) -> tuple[float, float, float]:
    p = kvatlas.plan("deepseek-v4-flash", "120GiB", max_running_requests=8, max_model_len=PROMPT + 1024,
                     prefix_checkpoints=640)
    a = Allocator(p, Ledger(p, _NoArena()))
    # every page boundary keeps its resume point, so the match walks all 511 cached pages (the
    # default policy would resume at its last kept point before the end, a shorter walk)
    pc = PrefixCache(a, a.ledger, policy="every-page")
    ids = np.random.default_rng(0).integers(0, 150_000, PROMPT)
    pc.admit("warm", PROMPT, 1, token_ids=ids)
    for _ in range(PROMPT // 8192):
        a.extend("warm", 8192)
    a.step(["warm"])
    pc.finish("warm", token_ids=ids)
    hashing, admitting = [], []
    for i in range(repeats):
        t = time.perf_counter()
        page_keys(ids, 256)
        hashing.append(time.perf_counter() - t)
        t = time.perf_counter()
        adm = pc.admit(i, PROMPT, 1, token_ids=ids)
        admitting.append(time.perf_counter() - t)
        assert adm.cached_tokens == PROMPT - 256, adm.cached_tokens   # every page but the last one
        pc.finish(i)
    return statistics.median(hashing), statistics.median(admitting), pc.stats.hit_ratio


def setup(requests: int, prefix: bool):
    opts = dict(max_running_requests=requests, max_model_len=32768)
    if prefix:
        opts["prefix_checkpoints"] = 256
    p = kvatlas.plan("deepseek-v4-flash", "120GiB", **opts)
    a = Allocator(p, Ledger(p, _NoArena()))
    pc = PrefixCache(a, a.ledger) if prefix else None
    lengths = np.random.default_rng(0).integers(100, 4000, requests)   # the same starts with and without
    ids = np.random.default_rng(1)
    for r, n in enumerate(lengths.tolist()):
        if pc is not None:
            pc.admit(r, 4096, 4096, token_ids=ids.integers(0, 150_000, 4096))
        else:
            a.admit(r, 4096, 4096)
        a.extend(r, n)
    a.flush()
    return a


def step_cost(requests: int, steps: int) -> tuple[float, float]:
    """(off, on): seconds per step, the median over interleaved blocks of two upkeep cycles."""
    off, on = setup(requests, False), setup(requests, True)
    block = 2 * on._defer_limit
    rids = list(range(requests))
    b_off, b_on = off.batch(rids), on.batch(rids)
    for _ in range(block):
        off.step(b_off)
        on.step(b_on)
    t_off, t_on = [], []
    for _ in range(max(steps // block, 1)):
        t = time.perf_counter()
        for _ in range(block):
            off.step(b_off)
        t_off.append((time.perf_counter() - t) / block)
        t = time.perf_counter()
        for _ in range(block):
            on.step(b_on)
        t_on.append((time.perf_counter() - t) / block)
    assert off.length.tolist() == on.length.tolist()   # the same work
    return statistics.median(t_off), statistics.median(t_on)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=1280)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    h, m, _ = admit_cost(args.repeats)
    print(f"128K-token prompt: hash token ids {h * 1e3:.2f} ms; match + admit (all pages cached) "
          f"{m * 1e3:.2f} ms; ratio {m / h:.2f}x (target ≤ 3x)")
    t_off, t_on = step_cost(args.requests, args.steps)
    print(f"decode step, {args.requests} requests: prefix cache off {t_off * 1e6:.1f} µs, on {t_on * 1e6:.1f} µs; "
          f"ratio {t_on / t_off:.3f}x (target ≤ 1.10x)")


if __name__ == "__main__":
    main()
