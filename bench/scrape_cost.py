"""Scrape cost with 16 vs 1,024 running requests, V4-Pro, in one run (target: ratio < 1.5).

Three costs, each a median over --reps scrapes:
- collect: KvatlasCollector.collect() (one ledger snapshot + building the metric families);
- text:    collect + the Prometheus text exposition (generate_latest);
- http:    GET /metrics from kvatlas.server over loopback (what Prometheus pays).
The cache alternates 16 and 1,024 running requests (each prefilled 64 tokens), --rounds times, so
drift on a shared machine hits both sides. To fit this shared CPU host (~7 GiB free while measured), the cache
is one pipeline stage of four (pp=4, rank 0: the first 16 of 61 layers, so samples carry pp_rank)
with "online" C128 state (one row per layer and request, not a 128-row ring) and 256-token
requests. A snapshot walks the pools' buffers (the same ~10 on every stage), never layers, pages or
requests, so neither choice changes what a scrape costs.

    python bench/scrape_cost.py [--reps 100] [--rounds 4] [--append bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import time
import urllib.request

import kvatlas
from kvatlas import server
from kvatlas.observing.metrics import KvatlasCollector, registry_for
from prometheus_client import generate_latest

MODEL, LOW, HIGH, PREFILL = "deepseek-v4-pro", 16, 1024, 64


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def resize(cache, running: set, n: int) -> None:
    """Admit (and prefill) or finish requests until n are running."""
    while len(running) > n:
        cache.finish(running.pop())
    new = [f"r{i}" for i in range(n * 2) if f"r{i}" not in running][: n - len(running)]
    for rid in new:
        cache.admit(rid, PREFILL, 16)
        running.add(rid)
    for k in range(0, len(new), 8192 // PREFILL):   # one forward pass per chunk budget
        with cache.allocator.forward():
            for rid in new[k:k + 8192 // PREFILL]:
                cache.extend(rid, PREFILL)


def measure(cache, url: str, reps: int) -> dict:
    col = KvatlasCollector(cache)
    reg = registry_for(col)

    def http():
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            r.read()

    return {"collect": timed(lambda: list(col.collect()), reps), "text": timed(lambda: generate_latest(reg), reps),
            "http": timed(http, reps)}


def run(reps: int, rounds: int, full: bool = False, device: str = "cpu") -> dict:
    if full:   # the whole model, every layer, 128-row C128 rings (~30 GiB: a GPU or a large host)
        p = kvatlas.budget_for(MODEL, num_requests=HIGH, context_tokens=256, max_running_requests=HIGH)
    else:
        p = kvatlas.budget_for(MODEL, num_requests=HIGH, context_tokens=256, max_running_requests=HIGH,
                               online_c128=True, pp=4, pp_rank=0)
    cache = kvatlas.allocate(p, device=device)
    running: set = set()
    samples = {LOW: {}, HIGH: {}}
    with server.start(cache) as h:
        for n in (LOW, HIGH) * rounds:
            resize(cache, running, n)
            assert cache.ledger.snapshot().running_requests == n
            for k, v in measure(cache, h.url, reps).items():
                samples[n].setdefault(k, []).extend(v)
    cache.check_integrity()
    config = ("all 61 layers, pp=1, 128-row C128 rings" if full
              else "pp=4 rank 0, online C128 state")
    return {"plan_bytes": p.total_bytes, "samples": samples, "config": config, "device": str(cache.device)}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def report(res: dict, reps: int, cmd: str) -> str:
    s = res["samples"]
    lines = [f"## scrape_cost — {datetime.date.today().isoformat()}", "",
             f"- machine: {os.cpu_count()} CPUs (`nproc` {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()}), "
             f"{cpu_model()}; shared with other jobs while measured",
             f"- command: `{cmd}`",
             f"- {MODEL}, {res['config']}, plan {res['plan_bytes'] / 2**30:.2f} GiB on {res['device']}, 256-token "
             f"requests; {reps} scrapes per phase, phases alternating 16 and 1,024 running requests "
             f"({len(s[LOW]['collect']) // reps} of each)", "",
             "| cost | median, 16 running | median, 1,024 running | ratio 1024/16 | p90, 1,024 |",
             "|---|---|---|---|---|"]
    for k in ("collect", "text", "http"):
        lo, hi = statistics.median(s[LOW][k]), statistics.median(s[HIGH][k])
        p90 = statistics.quantiles(s[HIGH][k], n=10)[-1]
        lines.append(f"| {k} | {lo * 1e3:.3f} ms | {hi * 1e3:.3f} ms | {hi / lo:.2f} | {p90 * 1e3:.3f} ms |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=100, help="scrapes per phase")
    ap.add_argument("--rounds", type=int, default=4, help="16 → 1,024 alternations")
    ap.add_argument("--append", help="append the result section to this markdown file")
    ap.add_argument("--full", action="store_true", help="the whole model (needs ~30 GiB on --device)")
    ap.add_argument("--device", default="cpu", help="where the cache lives (cpu or cuda)")
    args = ap.parse_args()
    res = run(args.reps, args.rounds, args.full, args.device)
    flags = (" --full" if args.full else "") + (f" --device {args.device}" if args.device != "cpu" else "")
    text = report(res, args.reps, f"python bench/scrape_cost.py --reps {args.reps} --rounds {args.rounds}{flags}")
    print(text)
    if args.append:
        with open(args.append, "a", encoding="utf-8") as fh:
            fh.write(("\n" if os.path.exists(args.append) and os.path.getsize(args.append) else "") + text)


if __name__ == "__main__":
    main()
