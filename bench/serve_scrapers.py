"""`kvatlas serve` forward passes per second with 8 concurrent scrapers against none, in one run
(target: ratio ≥ 0.8), and the scrapes' latency (p50, p99).

One `kvatlas serve` process runs a steady synthetic workload (Poisson arrivals for far longer than
the measurement, faster than the cache drains them: every pass has the same work). After a warm-up, phases of --phase-s seconds alternate between no scrapers and
--scrapers threads (in this process, as Prometheus would be in its own) that each GET /state and
/metrics back to back, as fast as the server answers. Forward passes are read from /state's
`workload.stats.steps` at each phase's start and end; alternating phases, --rounds times, put a
shared machine's drift on both sides. Each phase's passes/s are reported, the ratio is of the sums.

serve's time model paces passes (a pass takes --step-ms + per-token costs; the driver sleeps the
rest, as a real engine waits for its GPU). Here the per-token costs are 0 and --step-ms is 1 by
default: the driver is CPU-bound, so every millisecond a scrape takes from it shows (a paced
driver hides scrapes in its sleep).

    python bench/serve_scrapers.py [--scrapers 8] [--phase-s 4] [--rounds 5] [--step-ms 1] [--append bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

# Arrivals well above what 32 slots drain, so every pass has the same work: 32 requests running,
# a full prefill chunk. No KV writes (--write-layers 0): the driver is then Python and numpy
# only, holding the interpreter lock all pass long, the case scrapes hurt most (torch kernels
# would release it).
SERVE = ["deepseek-v4-flash", "--memory", "2GiB", "--max-running-requests", "32", "--max-model-len", "8192",
         "--chunked-prefill-tokens", "1024", "--draft-tokens", "1", "--rate", "40", "--duration", "100000",
         "--prompt-len", "uniform:128:1024", "--output-len", "uniform:32:128", "--port", "0", "--progress-s", "3600",
         "--write-layers", "0"]
CPU_BOUND = ["--prefill-us-per-token", "0", "--decode-us-per-token", "0"]


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()


def steps(url: str) -> int:
    return json.loads(get(url + "/state"))["workload"]["stats"]["steps"]


class Scrapers:
    """n threads scraping /state and /metrics in turn until stopped; latencies by path."""

    def __init__(self, url: str, n: int) -> None:
        self.url, self.n = url, n
        self.stop = threading.Event()
        self.lat: dict[str, list[float]] = {"/state": [], "/metrics": []}
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(n)]

    def _loop(self, i: int) -> None:
        paths = ["/state", "/metrics"] if i % 2 == 0 else ["/metrics", "/state"]
        k = 0
        while not self.stop.is_set():
            path = paths[k % 2]
            t = time.perf_counter()
            get(self.url + path)
            self.lat[path].append(time.perf_counter() - t)   # list.append is atomic under the GIL
            k += 1

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()


def start_serve(step_ms: float, paced: bool):
    flags = [*SERVE, *([] if paced else CPU_BOUND), "--step-ms", str(step_ms)]
    cmd = [sys.executable, "-m", "kvatlas", "serve", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    m = re.search(r"endpoints at (http://[^/\s]+)/metrics", line)
    if not m:
        proc.kill()
        raise SystemExit(f"serve did not start: {line}{proc.stderr.read()}")
    return proc, m.group(1), " ".join(["kvatlas serve", *flags])


def phase(url: str, n: int, seconds: float, lat: dict) -> float:
    s0, t0 = steps(url), time.perf_counter()
    if n:
        with Scrapers(url, n) as sc:
            time.sleep(seconds)
        for k, v in sc.lat.items():
            lat.setdefault(k, []).extend(v)
    else:
        time.sleep(seconds)
    s1, t1 = steps(url), time.perf_counter()
    return (s1 - s0) / (t1 - t0)


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scrapers", type=int, default=8)
    ap.add_argument("--phase-s", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-s", type=float, default=6.0)
    ap.add_argument("--step-ms", type=float, default=1.0)
    ap.add_argument("--paced", action="store_true", help="serve's default time model (with --step-ms 20): "
                    "passes sleep out their modelled time, as in the issue's measurement")
    ap.add_argument("--append", help="append the results as a section of this Markdown file")
    args = ap.parse_args()
    proc, url, serve_cmd = start_serve(args.step_ms, args.paced)
    try:
        time.sleep(args.warmup_s)   # the running set fills up to its steady size
        none, some, lat = [], [], {}
        for _ in range(args.rounds):
            none.append(phase(url, 0, args.phase_s, lat))
            some.append(phase(url, args.scrapers, args.phase_s, lat))
        running = json.loads(get(url + "/state"))["caches"][0]["ledger"]["running_requests"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    ratio = sum(some) / sum(none)
    scrapes = {k: (len(v), pct(v, 0.5) * 1e3, pct(v, 0.99) * 1e3) for k, v in lat.items()}
    lines = [
        f"- command: `python bench/serve_scrapers.py --scrapers {args.scrapers} --phase-s {args.phase_s} "
        f"--rounds {args.rounds} --step-ms {args.step_ms}{' --paced' if args.paced else ''}`",
        f"- serve: `{serve_cmd}` (CPU; {running} requests running at the end)",
        f"- forward passes/s, no scrapers: {', '.join(f'{x:.1f}' for x in none)} (median {statistics.median(none):.1f})",
        f"- forward passes/s, {args.scrapers} scrapers: {', '.join(f'{x:.1f}' for x in some)} "
        f"(median {statistics.median(some):.1f})",
        f"- **ratio {ratio:.3f}** (target ≥ 0.8)",
    ] + [f"- {k}: {n} scrapes, p50 {p50:.2f} ms, **p99 {p99:.2f} ms**" for k, (n, p50, p99) in scrapes.items()]
    text = "\n".join(lines)
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write(f"\n## serve_scrapers ({'paced' if args.paced else 'CPU-bound'}, step {args.step_ms:g} ms) — "
                    f"{datetime.date.today()}\n\n"
                    f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}\n"
                    + text + "\n")


if __name__ == "__main__":
    main()
