"""Prefix-cache hit ratio of N rank processes that share a store, against one cache that sees
every request with the same total memory (the best a content-blind router could do).

The Mooncake synthetic trace is dealt round-robin to `--ranks` rank processes (request i to rank
i mod N), V4-Flash, each rank `--device-gib` of device KV and a host tier; three runs from one
invocation, same trace loading, plans and accounting as bench/prefix_hit.py (25% of the device
budget for resume points; hit ratio = hit tokens / 512 over the trace's blocks):

1. one cache: N × device KV and N × (host + store share) of host tier;
2. N ranks, no shared tier: each N-th request, its own device KV and `--host-gib` host tier;
3. N ranks over one shared store: each `--device-gib` device KV, `--private-host-gib` host
   tier of its own, and `--host-gib - --private-host-gib` of its host memory lent to the store
   (Mooncake's model: each process contributes a segment), so the total memory equals run 1's.

Requests run one after another in trace order, as in bench/prefix_hit.py: a rank takes its turn
(a shared counter), serves its request — prefetch through device, host, store; admit; prefill;
finish, which writes through to the store — waits for its puts to land, and passes the turn.
So every request sees what every earlier one left, whichever rank served it, like run 1.

What is real and what is modeled: the allocator, the prefix cache, its tree, resume-point policy
and eviction are the real code (bookkeeping backend: no pool tensors); the host tiers are
`ModeledHost` (real slots and LRU, no memory); the store is a real server (Mooncake master, metadata
server and memory daemon in a network namespace with only `lo`, or redis-server on 127.0.0.1)
holding the real keys and the real 64-byte headers, each value's payload zeros of 1/1024 of its
bytes, so the store's own memory pressure, eviction and first-writer-wins act on the modeled
sizes (the segment is the store share / 1024). Bytes moved are counted at the real sizes.

    python bench/shared_tier_ranks.py --trace mooncake_synthetic.jsonl [--ranks 4] [--store mooncake]
        [--device-gib 32] [--host-gib 32] [--private-host-gib 8] [--limit N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from prefix_hit import TRACE, load, make_plan  # noqa: E402

SCALE = 1024
SHARE = 0.25          # of the device budget, for resume points (bench/prefix_hit.py)
HOST_SHARE = 1 / 3    # of a host tier, for resume points (the default)


def serve(trace, order, device_gib, host_gib, link_for, on_turn=None) -> dict:
    """Run the requests `order` (trace indices) on one cache; `on_turn(i, fn)` runs fn in turn."""
    from kvatlas.alloc import Allocator
    from kvatlas.prefix import PrefixCache
    from kvatlas.tiers.modeled import ModeledHost
    p = make_plan(device_gib, SHARE)
    a = Allocator(p)
    pc = PrefixCache(a, policy="kvatlas")
    link = link_for(pc, ModeledHost(p, int(host_gib * (1 << 30)), HOST_SHARE)) if host_gib else None
    chunk = p.options.chunked_prefill_tokens
    t0 = time.perf_counter()

    def one(i):
        prompt, out, keys = trace[i]
        if link is not None:
            link.prefetch(prompt, page_keys=keys)
        done = pc.admit(i, prompt, out, page_keys=keys).cached_tokens
        while done < prompt + out:
            n = min(chunk, prompt + out - done)
            a.extend(i, n)
            done += n
        pc.finish(i)
        if link is not None and hasattr(link, "shared"):
            link.shared.flush(30.0)    # its puts land before the next request anywhere

    for i in order:
        (on_turn(i, one) if on_turn else one(i))
    r = {"hit_tokens": pc.stats.hit_tokens, "queried_tokens": pc.stats.queried_tokens, "requests": len(order),
         "missed": pc.stats.missed(), "seconds": time.perf_counter() - t0}
    if link is not None:
        snap = link.snapshot()
        r["host_hit_tokens"] = snap.hits["host_hit_tokens"]
        shared = link.shared_snapshot()
        if shared is not None:
            r["shared"] = shared.to_dict()
            link.shared.close()
    return r


def rank_main(rank, n, trace_path, limit, device_gib, host_gib, url, turn, cond, out_q) -> None:
    trace = _trace(trace_path, limit)
    order = list(range(rank, len(trace), n))
    link_for = None
    if url:
        from kvatlas.tiers.shared import modeled_shared_link
        link_for = lambda pc, host: modeled_shared_link(pc, host, url, namespace="ranks", writer=rank + 1,  # noqa: E731
                                                        deadline_s=10.0, scale=SCALE)

    def on_turn(i, fn):
        with cond:
            cond.wait_for(lambda: turn.value == i)
        fn(i)
        with cond:
            turn.value = i + 1
            cond.notify_all()

    if link_for is None:
        from kvatlas.tiers import HostLink
        link_for = HostLink
    out_q.put((rank, serve(trace, order, device_gib, host_gib, link_for, on_turn if url else None)))


def _trace(path, limit):
    t = load(Path(path))
    return t[:limit] if limit else t


def ranks_run(args, url) -> list:
    ctx = mp.get_context("spawn")
    turn, cond, q = ctx.Value("q", 0), ctx.Condition(), ctx.Queue()
    host = args.private_host_gib if url else args.host_gib
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, str(args.trace), args.limit, args.device_gib, host,
                                               url, turn, cond, q)) for r in range(args.ranks)]
    for pr in procs:
        pr.start()
    got = dict(q.get(timeout=7200) for _ in procs)
    for pr in procs:
        pr.join(60)
    return [got[r] for r in range(args.ranks)]


def start_store(kind, store_gib):
    import store_servers as ss
    seg = max(16, int(store_gib * 1024 / SCALE))     # MiB: the store share at 1/1024 (16 MB at least)
    tmp = tempfile.mkdtemp()
    if kind == "redis":
        return ss.Redis(tmp, maxmemory=f"{seg}mb").start()
    return ss.Mooncake(tmp, segment=f"{seg}MB").start()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--device-gib", type=int, default=32)
    ap.add_argument("--host-gib", type=float, default=32)
    ap.add_argument("--private-host-gib", type=float, default=8)
    ap.add_argument("--store", default="mooncake", choices=("mooncake", "redis"))
    ap.add_argument("--runs", default="single,ranks,shared")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import store_servers as ss
    if args.store == "mooncake" and "shared" in args.runs and not ss.only_loopback_here():
        os.execvp("unshare", ["unshare", "-n", "--", sys.executable, *sys.argv])   # Mooncake's daemon binds everything
    if ss.only_loopback_here():
        ss.loopback_up()
    trace = _trace(args.trace, args.limit)
    blocks = sum(-(-prompt // 512) for prompt, _, _ in trace)
    n, out = args.ranks, {"blocks": blocks, "requests": len(trace), "args": {k: str(v) for k, v in vars(args).items()}}
    store_gib = n * (args.host_gib - args.private_host_gib)
    print(f"{len(trace)} requests, {blocks} blocks; {n} ranks × {args.device_gib} GiB device; host {args.host_gib} GiB "
          f"each (with the store: {args.private_host_gib} GiB own + {args.host_gib - args.private_host_gib} GiB lent: "
          f"a {store_gib:g} GiB store)", flush=True)
    from kvatlas.tiers import HostLink
    if "single" in args.runs:
        t = time.perf_counter()
        out["single"] = serve(trace, range(len(trace)), n * args.device_gib, n * args.host_gib, HostLink)
        out["single"]["wall_s"] = time.perf_counter() - t
        _line("one cache", out["single"], blocks)
    if "ranks" in args.runs:
        t = time.perf_counter()
        out["ranks"] = ranks_run(args, None)
        _line(f"{n} ranks, no shared tier", _sum(out["ranks"]), blocks, time.perf_counter() - t)
    if "shared" in args.runs:
        srv = start_store(args.store, store_gib)
        try:
            t = time.perf_counter()
            out["shared"] = ranks_run(args, srv.url)
            _line(f"{n} ranks + shared {args.store}", _sum(out["shared"]), blocks, time.perf_counter() - t)
        finally:
            srv.stop()
    if "single" in out:
        for k in ("ranks", "shared"):
            if k in out:
                out[f"{k}_vs_single"] = _sum(out[k])["hit_tokens"] / max(out["single"]["hit_tokens"], 1)
                print(f"{k}: {out[f'{k}_vs_single']:.3f} of the one cache's hit tokens")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


def _sum(rows) -> dict:
    s = {"hit_tokens": sum(r["hit_tokens"] for r in rows), "queried_tokens": sum(r["queried_tokens"] for r in rows),
         "host_hit_tokens": sum(r.get("host_hit_tokens", 0) for r in rows)}
    if rows and "shared" in rows[0]:
        s["shared_hit_tokens"] = sum(r["shared"]["hit_tokens"] for r in rows)
        s["misses"] = {k: sum(sum(r["shared"]["misses"][kind][k] for kind in ("page", "checkpoint")) for r in rows)
                       for k in rows[0]["shared"]["misses"]["page"]}
        s["puts"] = {k: sum(sum(r["shared"]["puts"][kind][k] for kind in ("page", "checkpoint")) for r in rows)
                     for k in rows[0]["shared"]["puts"]["page"]}
    return s


def _line(name, r, blocks, wall=None) -> None:
    extra = f", shared {r['shared_hit_tokens'] / 512 / blocks:.2%}; store misses {r['misses']}; puts {r['puts']}" \
        if "shared_hit_tokens" in r else ""
    print(f"{name:>28}: hit {r['hit_tokens'] / 512 / blocks:.2%} (host {r.get('host_hit_tokens', 0) / 512 / blocks:.2%}"
          f"{extra})" + (f" [{wall:.0f} s]" if wall else ""), flush=True)


if __name__ == "__main__":
    main()
