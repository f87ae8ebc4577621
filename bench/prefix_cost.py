"""What the prefix cache costs, each figure a ratio measured in one run:

1. Matching and admitting a 128K-token prompt whose pages are all cached (keys from its token
   ids, the tree walk, the admission with 511 shared pages and a resume point) against hashing
   its token ids alone (`page_keys`). Target: ≤ 3×.
2. The decode step of bench/alloc_step.py (1,024 running requests, +1 token each) with the
   prefix cache on against the same step with it off. With it on, a step finds its resume rows
   (units taken ahead), and an upkeep makes the captures due, decides them and takes units for
   the next tails, every 52-63 tokens here (as often as the plan's checkpoint units require).
   The two allocators step one after the other (which goes first alternating), each step timed;
   the figure is the median, over windows of 256 steps (whole upkeep cycles), of the on time
   summed over the window against the off time. Target: ≤ 1.10×. The batch is steady (the same
   requests every step), so the resume rows come from a schedule (made once a page of progress,
   patched where units change); `--scan` times what a batch that changes every step pays
   instead (a scan of the batch).
3. `--scaling`: the same step at 64 / 256 / 1,024 / 4,096 running requests, with 256 and 4,096
   resume-point units, on against off: µs per step and per request. With more running requests
   than free units, the tails short of a unit take one as they are written, so the step must
   stay linear in running requests whatever the number of units (issue 34).

    python bench/prefix_cost.py [--requests 1024] [--steps 6400] [--repeats 20] [--scan]
    python bench/prefix_cost.py --scaling [--steps 1024] [--sizes 64,256,1024,4096] [--units 256,4096]
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
WINDOW = 256   # steps: four or five upkeep cycles (one every 52-63 tokens in this plan)


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


def setup(requests: int, prefix: bool, units: int = 256, as_written: bool = True):
    opts = dict(max_running_requests=requests, max_model_len=32768)
    if prefix:
        opts["prefix_checkpoints"] = units
    # (bookkeeping only, nothing allocated: a budget where 8,192 tokens each fit the largest batch)
    p = kvatlas.plan("deepseek-v4-flash", "120GiB" if requests <= 1024 else f"{requests * 120 // 1024}GiB", **opts)
    a = Allocator(p, Ledger(p, _NoArena()))
    pc = PrefixCache(a, a.ledger, share_as_written=as_written) if prefix else None
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


def step_pairs(requests: int, steps: int, scan: bool = False, units: int = 256,
               as_written: bool = True, owed: list | None = None) -> tuple[list, list]:
    """Seconds of each step, off and on: the two allocators step one after the other, which goes
    first alternating, so the machine's drift (its speed moves by tens of percent within a
    second on a shared VM) is the same for both. scan: the on side never uses a steady batch's
    schedule of resume rows (as when the batch changes every step). owed: a list that gets, at
    the end of every WINDOW steps, the seconds the prefix cache then takes to share the pages
    those steps completed (they join the tree when something reads it; nothing does here)."""
    off, on = setup(requests, False), setup(requests, True, units, as_written)
    cache = on.on_capture.__self__ if owed is not None else None
    if scan:
        on._steady_rows = lambda *args: None
    rids = list(range(requests))
    sides = [(off, off.batch(rids), []), (on, on.batch(rids), [])]
    for _ in range(128):   # two whole upkeep cycles before timing
        for a, batch, _ in sides:
            a.step(batch)
    if cache is not None:
        cache.tree
    clock = time.perf_counter
    for i in range(steps):
        for a, batch, times in (sides if i % 2 == 0 else sides[::-1]):
            t = clock()
            a.step(batch)
            times.append(clock() - t)
        if cache is not None and (i + 1) % WINDOW == 0:
            t = clock()
            cache.tree   # (reading it shares what the passes completed)
            owed.append(clock() - t)
    assert off.length.tolist() == on.length.tolist()   # the same work
    return sides[0][2], sides[1][2]


def window_ratios(off: list, on: list, window: int = WINDOW) -> list:
    """on / off summed over consecutive windows of steps: a window holds whole upkeep cycles (a
    median over single steps would leave the upkeep out)."""
    return [sum(on[i:i + window]) / sum(off[i:i + window]) for i in range(0, len(off) - window + 1, window)]


def scaling(sizes, units_list, steps: int) -> None:
    """µs per step and per request, off and on, at each size and number of units (one line each)."""
    print("| running | units | off µs/step | on µs/step | on µs/request | on/off (windows of 256) |")
    print("|---|---|---|---|---|---|")
    for units in units_list:
        for n in sizes:
            off, on = step_pairs(n, steps, units=units)
            ratio = statistics.median(window_ratios(off, on))
            t_off, t_on = sum(off) / len(off), sum(on) / len(on)   # means: the upkeep steps included
            print(f"| {n:,} | {units:,} | {t_off * 1e6:.1f} | {t_on * 1e6:.1f} | {t_on / n * 1e6:.3f} | {ratio:.3f}x |",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6400)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--scan", action="store_true", help="the on side finds resume rows by scanning the batch "
                    "every step, as a batch that changes every step does (no steady-batch schedule)")
    ap.add_argument("--at-finish", action="store_true", help="the cache shares a request's pages when it "
                    "finishes, not as they are written (share_as_written=False: the behaviour before issue 34)")
    ap.add_argument("--scaling", action="store_true", help="the step at several sizes and numbers of units")
    ap.add_argument("--sizes", default="64,256,1024,4096")
    ap.add_argument("--units", default="256,4096")
    args = ap.parse_args()
    if args.scaling:
        scaling([int(x) for x in args.sizes.split(",")], [int(x) for x in args.units.split(",")], args.steps)
        return
    h, m, _ = admit_cost(args.repeats)
    print(f"128K-token prompt: hash token ids {h * 1e3:.2f} ms; match + admit (all pages cached) "
          f"{m * 1e3:.2f} ms; ratio {m / h:.2f}x (target ≤ 3x)")
    owed: list = []
    off, on = step_pairs(args.requests, args.steps, args.scan, as_written=not args.at_finish, owed=owed)
    q = statistics.quantiles(window_ratios(off, on), n=4)
    how = (" (scan)" if args.scan else "") + (" (pages shared at finish)" if args.at_finish else "")
    print(f"decode step, {args.requests} requests{how}: prefix cache off {statistics.median(off) * 1e6:.1f} µs, "
          f"on {statistics.median(on) * 1e6:.1f} µs (medians); on/off over windows of {WINDOW} steps: "
          f"median {q[1]:.3f}x (target ≤ 1.10x), quartiles {q[0]:.3f} / {q[2]:.3f}; all steps {sum(on) / sum(off):.3f}x")
    # the same windows with the sharing they owe (pages shared when the tree is next read) added
    with_owed = [(sum(on[i * WINDOW:(i + 1) * WINDOW]) + owed[i]) / sum(off[i * WINDOW:(i + 1) * WINDOW])
                 for i in range(len(owed))]
    q = statistics.quantiles(with_owed, n=4)
    print(f"  with the pages those steps completed shared (one read of the tree a window, {len(owed)} windows, "
          f"{statistics.median(owed) * 1e6:.0f} µs each): median {q[1]:.3f}x, quartiles {q[0]:.3f} / {q[2]:.3f}")

if __name__ == "__main__":
    main()
