"""Which checksum the shared tier's values carry: XXH3-64 (the `xxhash` package) against CRC-32C
(`google-crc32c`; the `crc32c` package too where installed) over the ranges of real values — a
restore batch of V4-Flash pages and a resume point (the host plan's real range sizes: 786,240 +
177,408 + 34,560 B a page, 3,219,840 + 688,128 + 172,032 B a resume point), 20 MB, each range
hashed once a round, so the bytes come cold from memory as they do after a read — in one run,
rounds taking turns, on one thread and cut across two (does the library release the interpreter
lock?). Baselines in the same run: numpy's copy of the same bytes (memory speed) and the weighted
word sum the values carried before (format version 1). Ratio = baseline seconds / checksum seconds.

    python bench/shared_checksum.py [--pages 16] [--repeats 15] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

PAGE = (786240, 177408, 34560)
RESUME = (3219840, 688128, 172032)


def candidates() -> dict:
    import google_crc32c
    import xxhash
    out = {"xxh3_64": xxhash.xxh3_64_intdigest, f"google_crc32c ({google_crc32c.implementation})": google_crc32c.value}
    try:
        import crc32c
        out["crc32c"] = crc32c.crc32c
    except ImportError:
        pass
    return out


def weighted_sum(r) -> int:   # the version-1 checksum of one range (its words' sum; the weight is one multiply)
    return int(r.view(np.uint64).sum(dtype=np.uint64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json")
    a = ap.parse_args()
    sizes = list(PAGE) * a.pages + list(RESUME)
    slab = np.random.default_rng(0).integers(0, 256, sum(sizes) + (64 << 20), dtype=np.uint8)
    cut = np.cumsum([0] + sizes)
    ranges = [slab[x:y] for x, y in zip(cut[:-1], cut[1:])]
    flush = slab[cut[-1]:]         # 64 MiB touched between rounds: every range is cold when hashed
    sink = np.empty(cut[-1], np.uint8)
    fns = {"copy": lambda r: None, "weighted_sum (v1)": weighted_sum, **candidates()}
    pool = ThreadPoolExecutor(1)
    times: dict = {f"{n} x{t}": [] for n in fns for t in (1, 2)}
    for rnd in range(a.repeats):
        order = list(times)
        order = order[rnd % len(order):] + order[:rnd % len(order)]
        for name in order:
            fn, threads = fns[name.rsplit(" x", 1)[0]], int(name.rsplit(" x", 1)[1])
            flush += 1
            if name.startswith("copy "):   # the same bytes into another buffer
                t = time.perf_counter()
                if threads == 1:
                    np.copyto(sink, slab[:cut[-1]])
                else:
                    h = cut[-1] // 2
                    f = pool.submit(np.copyto, sink[h:], slab[h:cut[-1]])
                    np.copyto(sink[:h], slab[:h])
                    f.result()
                times[name].append(time.perf_counter() - t)
                continue
            t = time.perf_counter()
            if threads == 1:
                for r in ranges:
                    fn(r)
            else:
                f = pool.submit(lambda: [fn(r) for r in ranges[1::2]])
                for r in ranges[0::2]:
                    fn(r)
                f.result()
            times[name].append(time.perf_counter() - t)
    nbytes = int(cut[-1])
    base = statistics.median(times["weighted_sum (v1) x1"])
    rows = []
    print(f"{nbytes:,} B a batch ({a.pages} pages + a resume point, {len(ranges)} ranges), median of {a.repeats}")
    print(f"{'':>34} {'ms':>8} {'GB/s':>7} {'v1 s / this s':>14}")
    for name, ts in times.items():
        m = statistics.median(ts)
        rows.append({"name": name, "s": m, "GBps": nbytes / m / 1e9, "ratio_to_v1": base / m, "all_s": ts})
        print(f"{name:>34} {m * 1e3:>8.2f} {nbytes / m / 1e9:>7.2f} {base / m:>14.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bytes": nbytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
