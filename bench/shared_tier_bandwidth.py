"""Restore bandwidth from the shared tier against the store's own get of the same bytes, in one
run, with real bytes: V4-Flash pages and resume points (CPU tensors in the host tier's buffers,
the plan's real sizes: 998,208 B a page, 4,080,000 B a resume point) through a real store.

One process writes (the host tier's slots filled with random bytes, put through the shared tier:
header, checksum, one multi-range put per batch; and the same bytes put again, raw, under other
keys as one contiguous value each); a second process reads both back, interleaved, `--repeats`
times: the tier's read (into the host tier's slots, one range per host buffer, size, header and
checksum checked) against the store's plain read of the same values into one registered buffer.
Each read's destination is zeroed just before it, the three reads take turns (each first in a
third of the rounds), and each is checked byte for byte against what was written. Ratio = plain seconds / tier seconds
(1.0: the tier costs nothing over the store). Also timed: the store's own read of the tier's values
straight into the host buffers (a header slot and one range per host buffer, nothing checked), and
the tier against that. Servers on loopback (Mooncake in a network namespace
with only `lo`, started here; redis-server with every bind on 127.0.0.1).

    python bench/shared_tier_bandwidth.py [--store mooncake|redis|both] [--pages 16] [--repeats 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def _tier(url: str, namespace: str):
    import kvatlas
    from kvatlas.planning.hostplan import HOST_CHECKPOINTS, HOST_PAGES
    from kvatlas.tiers import HostTier
    from kvatlas.tiers.shared import SharedTier, layout_of, open_store
    p = kvatlas.plan("deepseek-v4-flash", "2GiB", max_running_requests=4, max_model_len=8192, prefix_checkpoints=8)
    cache = kvatlas.allocate(p)
    host = HostTier(cache, "160MiB", checkpoint_share=0.2)
    store = open_store(url)
    store.register(host.memory.slab.numpy())
    tier = SharedTier(store, layout_of(host.plan, p, namespace), deadline_s=30.0)
    return host, store, tier, {"page": HOST_PAGES, "checkpoint": HOST_CHECKPOINTS}


def _entries(host, groups, pages: int):
    from kvatlas.tiers.shared import Entry
    out = [Entry("page", 1000 + i, 0, host.entry_parts(groups["page"], i)) for i in range(pages)]
    out.append(Entry("checkpoint", 999, 256 * pages, host.entry_parts(groups["checkpoint"], 0)))
    return out


def write(url: str, namespace: str, pages: int, seed: int) -> None:
    host, store, tier, groups = _tier(url, namespace)
    rng = np.random.default_rng(seed)
    slab = host.memory.slab.numpy()
    slab[:] = rng.integers(0, 256, slab.nbytes, dtype=np.uint8)
    entries = _entries(host, groups, pages)
    tier.put(entries)
    tier.flush(60.0)
    raw = [np.concatenate(e.parts) for e in entries]
    for a in raw:
        store.register(a)
    assert store.put_many([f"raw/{namespace}/{i}" for i in range(len(raw))], [[a] for a in raw]) == ["stored"] * len(raw)
    assert tier.snapshot().puts["page"]["stored"] == pages


def read(url: str, namespace: str, pages: int, seed: int, repeats: int) -> dict:
    host, store, tier, groups = _tier(url, namespace)
    rng = np.random.default_rng(seed)
    want = rng.integers(0, 256, host.memory.slab.numpy().nbytes, dtype=np.uint8)
    entries = _entries(host, groups, pages)
    nbytes = sum(sum(p.nbytes for p in e.parts) for e in entries)
    flat = np.zeros(nbytes, np.uint8)
    store.register(flat)
    sizes = [sum(p.nbytes for p in e.parts) for e in entries]
    cuts = np.cumsum([0] + sizes)
    dests = [[flat[a:b]] for a, b in zip(cuts[:-1], cuts[1:])]
    keys = [f"raw/{namespace}/{i}" for i in range(len(entries))]
    base = host.memory.slab.numpy().ctypes.data   # where the slab starts: each part is a range of it
    # the store's own read of the tier's values straight into the host buffers (a header slot and
    # one range per host buffer): the layout's cost without any of the tier's checks
    heads = np.zeros((len(entries), 64), np.uint8)
    store.register(heads)
    tkeys = [tier.layout.key(e.kind, e.page_key) for e in entries]
    into = [[heads[i]] + list(e.parts) for i, e in enumerate(entries)]
    tier_s, plain_s, into_s, tier_get_s = [], [], [], []   # tier_get_s: its store calls alone

    def poison_parts():
        for e in entries:
            for p in e.parts:
                p[:] = 0

    def tier_read():
        poison_parts()
        g = tier.c.op_seconds["get"]
        t = time.perf_counter()
        reasons = tier.get(entries).reasons
        tier_s.append(time.perf_counter() - t)
        tier_get_s.append(tier.c.op_seconds["get"] - g)
        assert reasons == [None] * len(entries), reasons
        for e in entries:
            for q in e.parts:
                at = q.ctypes.data - base
                assert np.array_equal(q, want[at: at + q.nbytes])

    def plain_read():
        flat[:] = 0
        t = time.perf_counter()
        got = store.get_many(keys, dests)
        plain_s.append(time.perf_counter() - t)
        assert got == sizes

    def into_read():
        poison_parts()
        t = time.perf_counter()
        got = store.get_many(tkeys, into)
        into_s.append(time.perf_counter() - t)
        assert got == [64 + n for n in sizes]

    reads = [tier_read, plain_read, into_read]
    for r in range(repeats):   # in turns, each first in a third of the rounds: drift and order hit them alike
        for fn in reads[r % 3:] + reads[: r % 3]:
            fn()
    assert np.array_equal(flat, np.concatenate([np.concatenate(e.parts) for e in entries]))
    t, pl, it = statistics.median(tier_s), statistics.median(plain_s), statistics.median(into_s)
    return {"bytes": nbytes, "entries": len(entries), "tier_s": t, "plain_s": pl, "tier_GBps": nbytes / t / 1e9,
            "plain_GBps": nbytes / pl / 1e9, "ratio": pl / t, "tier_all_s": tier_s, "plain_all_s": plain_s,
            "tier_store_calls_s": statistics.median(tier_get_s), "into_host_s": it, "into_host_GBps": nbytes / it / 1e9, "ratio_into_host": it / t}


def run_store(kind: str, args) -> dict:
    import store_servers as ss
    tmp = tempfile.mkdtemp()
    srv = (ss.Redis(tmp) if kind == "redis" else ss.Mooncake(tmp, segment="512MB")).start()
    try:
        t = time.perf_counter()
        me = [sys.executable, os.path.abspath(__file__), "--role"]
        subprocess.run(me + ["write", "--url", srv.url, "--pages", str(args.pages)], check=True)
        out = subprocess.run(me + ["read", "--url", srv.url, "--pages", str(args.pages), "--repeats", str(args.repeats)],
                             check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        r.update(store=kind, wall_s=time.perf_counter() - t)
        return r
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default="both", choices=("mooncake", "redis", "both"))
    ap.add_argument("--pages", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json")
    ap.add_argument("--role", choices=("write", "read"), help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "write":
        return write(args.url, "bw", args.pages, 5)
    if args.role == "read":
        return print(json.dumps(read(args.url, "bw", args.pages, 5, args.repeats)))
    import store_servers as ss
    if "mooncake" in (args.store, "both") and not ss.only_loopback_here():   # Mooncake's daemon binds everything
        os.execvp("unshare", ["unshare", "-n", "--", sys.executable, *sys.argv])
    if ss.only_loopback_here():
        ss.loopback_up()
    rows = [run_store(k, args) for k in (("mooncake", "redis") if args.store == "both" else (args.store,))]
    print(f"{'store':>9} {'bytes':>12} {'tier GB/s':>10} {'store GB/s':>11} {'ratio':>6} "
          f"{'store into host GB/s':>21} {'ratio':>6}")
    for r in rows:
        print(f"{r['store']:>9} {r['bytes']:>12,} {r['tier_GBps']:>10.3f} {r['plain_GBps']:>11.3f} {r['ratio']:>6.3f} "
              f"{r['into_host_GBps']:>21.3f} {r['ratio_into_host']:>6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
