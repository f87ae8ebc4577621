"""kvatlas's eviction against an oracle's on the shared trace, concurrent, one budget: how far
below what eviction could reach with the future known the cache hits.

Every run is `bench/prefix_vllm.py`'s concurrent kvatlas run (the trace's arrivals, prefix-first
admission over `--window` waiting requests, V4-Flash, resume points a `--share` of the budget,
`--max-running` slots); only the eviction order differs (`--evictions`, each one run):
- kvatlas: as shipped (LRU with reuse credit, leaves first, queue-aware: pages and points a
  waiting request would read go last);
- oracle: Belady's rule over the trace's future: the idle leaf page, and the resume point, whose
  next reader (the earliest request not yet admitted whose prompt holds its key) comes latest go
  first, never-read-again ones before all. Each entry is ranked as it is pushed (when its node
  becomes an idle leaf or is read); a request admitted without reading a page it holds does not
  re-rank it, so this is an approximation of Belady's, not a proof of a bound: it shows what a
  rule that knew the future would gain here;
- oracle-pages / oracle-points: the oracle's order for pages only (points as shipped) / for
  resume points only;
- read-first: pages never read since written go before every page read at least once (LRU
  within each), a rule that needs no future;
- kvatlas-wW (`--reuse-weights`): kvatlas's own order with reuse credit weight W (the shipped
  0.5: `allocate(..., prefix_reuse_weight=W)`; 0 is plain LRU, leaves first);
- kvatlas-cC-wW (`--reuse-caps C:W,...`): the same with reads counted up to C (the shipped 4):
  C=1 with a large W tends to read-first, except that the credit is in lifetimes;
- floor-F (`--idle-floors`): kvatlas's order, and an admission past 8 running requests waits
  while it would leave fewer than F of the full pages idle in the cache (a floor the running
  requests may not take): fewer running requests when the cache is under pressure, the plan's
  slots unchanged.

    cd bench && python prefix_oracle.py --trace ../shared/traces/mooncake_synthetic.jsonl [--budget 16] \
        [--evictions kvatlas,oracle,oracle-pages,oracle-points,read-first] [--reuse-weights 0,1,2] \
        [--reuse-caps 1:1,1:8] [--idle-floors 0.2,0.5,0.8]
"""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

import numpy as np

import kvatlas
import kvatlas.prefix.tree as tree_module
from kvatlas.prefix.tree import Tree

sys.path.insert(0, str(Path(__file__).resolve().parent))
import prefix_hit  # noqa: E402
import prefix_vllm  # noqa: E402

NEVER = 1 << 40


class Future:
    """Each page key's readers in arrival order, and which have been admitted."""

    def __init__(self, cache, requests) -> None:
        uses: dict[int, list] = {}
        self.index = {r.id: i for i, r in enumerate(requests)}
        for i, r in enumerate(requests):
            ids = r.token_ids()
            if ids is None:
                continue
            for k in cache.prefix.prompt_keys(ids, r.prompt_tokens).keys.tolist():
                uses.setdefault(k, []).append(i)
        self.uses = uses
        self.cursor = dict.fromkeys(uses, 0)
        self.admitted = np.zeros(len(requests), bool)

    def next_use(self, key: int) -> int:
        readers = self.uses.get(key)
        if readers is None:
            return NEVER
        c, admitted = self.cursor[key], self.admitted
        while c < len(readers) and admitted[readers[c]]:
            c += 1
        self.cursor[key] = c
        return readers[c] if c < len(readers) else NEVER


def oracle_tree(future: Future):
    """Tree._push_page / _push_ckpt ranking by next use instead of last use (the entries keep
    their shapes, so the tree's own staleness checks hold)."""

    def push_page(self, i: int):
        if self.base and self.refs[i] == 0 and self.children[i] == 0:
            self._seq += 1
            stamp = int(self.last_used[i])
            used = -future.next_use(int(self.key[i]))   # furthest next use pops first
            self.due[i] = used
            entry = (used, self._seq, stamp, i, int(self.gen[i]))
            heapq.heappush(self._pages, entry)
            return entry
        return None

    def push_ckpt(self, ck) -> None:
        self._seq += 1
        heapq.heappush(self._ckpts, (-future.next_use(int(self.key[ck.node])), ck.last_used, self._seq, ck))

    return push_page, push_ckpt


def read_first(self, i: int):
    """Tree._push_page where a page read at least once ranks after every page never read."""
    if self.base and self.refs[i] == 0 and self.children[i] == 0:
        self._seq += 1
        stamp = used = int(self.last_used[i])
        if used > self._now:
            self._now = used
        if int(self.reads[i]):
            used += NEVER
        self.due[i] = used
        entry = (used, self._seq, stamp, i, int(self.gen[i]))
        heapq.heappush(self._pages, entry)
        return entry
    return None


EVICTIONS = ("kvatlas", "oracle", "oracle-pages", "oracle-points", "read-first")
FLOOR_FROM = 8   # floor-F: running requests admitted whatever the floor


def idle_floor(cache, floor: float) -> None:
    """cache.can_admit, and past FLOOR_FROM running requests also no while the admission would
    leave fewer than `floor` of the full pages idle in the cache (floor-F in the module doc)."""
    can, pc, alloc = cache.can_admit, cache.prefix, cache.allocator
    least = floor * cache.plan.num_full_pages

    def floored(prompt_tokens, max_new_tokens=0, **kwargs):
        if not can(prompt_tokens, max_new_tokens, **kwargs):
            return False
        if len(alloc.slot_of) < FLOOR_FROM:
            return True
        m = pc._match(prompt_tokens, kwargs.get("token_ids"), kwargs.get("page_keys"))
        need, _ = pc._room(m, prompt_tokens + max_new_tokens)
        evicted = max(0, need - (alloc.full.free - alloc.outstanding))
        return pc._tree.idle_pages - evicted >= least

    cache.can_admit = floored


def run(p, requests, window: int, eviction: str) -> dict:
    cap, weight, floor = tree_module.REUSE_CAP, None, None
    if eviction.startswith("kvatlas-c"):
        c, w = eviction[len("kvatlas-c"):].split("-w")
        cap, weight = int(c), float(w)
    elif eviction.startswith("kvatlas-w"):
        weight = float(eviction[len("kvatlas-w"):])
    elif eviction.startswith("floor-"):
        floor = float(eviction[len("floor-"):])
    cache = kvatlas.allocate(p, backend="none", **({} if weight is None else {"prefix_reuse_weight": weight}))
    if floor is not None:
        idle_floor(cache, floor)
    future = Future(cache, requests) if eviction.startswith("oracle") else None
    saved = Tree._push_page, Tree._push_ckpt, tree_module.REUSE_CAP
    tree_module.REUSE_CAP = cap
    if future is not None:   # (marked before the admission: it reads the pages, not their next use)
        admit, index = cache.admit, future.index

        def admit_marked(rid, *args, **kwargs):
            future.admitted[index[rid]] = True
            return admit(rid, *args, **kwargs)

        cache.admit = admit_marked
    try:
        if future is not None:
            pages, points = oracle_tree(future)
            if eviction != "oracle-points":
                Tree._push_page = pages
            if eviction != "oracle-pages":
                Tree._push_ckpt = points
        elif eviction == "read-first":
            Tree._push_page = read_first
        r = prefix_vllm.kvatlas_concurrent(p, requests, prefix_vllm.default_time_model(), window=window,
                                           queue_aware=future is None, cache=cache)
    finally:
        Tree._push_page, Tree._push_ckpt, tree_module.REUSE_CAP = saved
    return {"hit": int(r["hits"].sum()) / sum(x.prompt_tokens for x in requests), "passes": r["passes"],
            "peak_running": r["peak_running"], "ttft": r["ttft_s"]["mean"],
            "evicted": cache.prefix.stats.evicted_pages}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--budget", type=int, default=16, help="GiB (default 16)")
    ap.add_argument("--share", type=float, default=0.15, help="resume points' share of the budget (default 0.15)")
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--window", type=int, default=4096, help="prefix-first admission window (default 4,096)")
    ap.add_argument("--evictions", default="kvatlas,oracle", help=f"runs, of {', '.join(EVICTIONS)} "
                    "(default kvatlas,oracle)")
    ap.add_argument("--reuse-weights", default="", help="also kvatlas's order at these reuse-credit weights, "
                    "e.g. 0,1,2 (the shipped weight is 0.5)")
    ap.add_argument("--reuse-caps", default="", help="also kvatlas's order with reads counted up to C at weight W, "
                    "C:W pairs, e.g. 1:1,1:8 (shipped: 4:0.5)")
    ap.add_argument("--idle-floors", default="", help="also kvatlas's order with admission keeping this share of "
                    "the full pages idle past 8 running, e.g. 0.2,0.5,0.8")
    args = ap.parse_args()
    evictions = args.evictions.split(",") + [f"kvatlas-w{w}" for w in args.reuse_weights.split(",") if w]
    evictions += [f"kvatlas-c{c.split(':')[0]}-w{c.split(':')[1]}" for c in args.reuse_caps.split(",") if c]
    evictions += [f"floor-{f}" for f in args.idle_floors.split(",") if f]
    for e in evictions:
        if e not in EVICTIONS and not e.startswith(("kvatlas-w", "kvatlas-c", "floor-")):
            ap.error(f"--evictions: {e!r} is not one of {', '.join(EVICTIONS)}")
    p = prefix_hit.make_plan(args.budget, args.share, max_running_requests=args.max_running)
    _, requests = prefix_vllm.load(args.trace, 0)
    rows = [(name, run(p, requests, args.window, name)) for name in evictions]
    print(f"{args.budget} GiB, {args.max_running} running at most, window {args.window}, share {args.share} "
          f"({p.options.prefix_checkpoints} resume points)")
    print("| eviction | hit (prompt tokens) | passes | TTFT mean s | peak running | pages evicted |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['hit']:.2%} | {r['passes']:,} | {r['ttft']:.2f} | {r['peak_running']} | {r['evicted']:,} |")
    got = dict(rows)
    if "kvatlas" in got and "oracle" in got:
        print(f"kvatlas / oracle: {got['kvatlas']['hit'] / got['oracle']['hit']:.4f}")


if __name__ == "__main__":
    main()
