"""SGLang plugin: cost of its metrics with 16 vs 1,024 running requests, in one run (target ratio ≤ 1.5).

Runs in the SGLang venv (`bash tests/sglang_plugin/setup_env.sh`). SGLang 0.5.23's own pools for
V4-Flash are built on the CPU by its own configurator (`kvatlas.integrations.sglang.plugin.build_offline`,
1,024 request slots, a 32 GiB budget that is reserved but never touched), with prometheus_client in
multiprocess mode as in an SGLang server. Requests are admitted through SGLang's own allocators
(a request-table row, then one 256-token prefill: one full page and one SWA page each).

Two costs, each a median over --reps:
- refresh: what the plugin's log_stats hook does on the scheduler (read SGLang's allocator
  counters, one ledger snapshot, write every gauge);
- scrape:  refresh + what SGLang's HTTP server does per /metrics for these gauges (a
  MultiProcessCollector over the directory, then the text exposition).
Phases alternate 16 and 1,024 running requests (--rounds of each), so drift on a shared machine
hits both sides.

    .venv-sglang/bin/python bench/sglang_scrape.py [--reps 200] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="kvatlas-bench-"))

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

LOW, HIGH, TOKENS = 16, 1024, 256


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


class Running:
    """Requests held in SGLang's allocators, admitted and finished the way its scheduler does, in
    batches of 16 (one alloc_extend per batch, as one prefill forward pass)."""

    BATCH = 16

    def __init__(self, pools) -> None:
        self.pools, self.held = pools, []   # (request-table rows, token locations) per batch

    def set(self, n: int) -> None:
        import torch
        req, alloc = self.pools.req_to_token_pool, self.pools.token_to_kv_pool_allocator
        done = []
        while len(self.held) * self.BATCH > n:
            done.append(self.held.pop())
        if done:   # finished requests freed in one call, as a scheduler step frees its finished batch
            alloc.free(torch.cat([locs for _, locs in done]))
            req.free_rows([s for slots, _ in done for s in slots])
        b = self.BATCH
        zero, length = torch.zeros(b, dtype=torch.int64), torch.full((b,), TOKENS, dtype=torch.int64)
        while len(self.held) * b < n:
            slots = req.alloc_rows(b)
            locs = alloc.alloc_extend(zero, zero, length, length, torch.full((b,), -1, dtype=torch.int64), b * TOKENS)
            assert slots is not None and locs is not None, "pool too small for the benchmark"
            self.held.append((slots, locs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    args = ap.parse_args()
    logging.disable(logging.WARNING)   # SGLang's start-up log
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    from kvatlas.integrations.sglang import plugin as ks
    offline = ks.build_offline("deepseek-v4-flash", "32GiB", max_running_requests=HIGH, context_length=8192)
    running = Running(offline.pools)

    def scrape() -> bytes:
        ks.refresh()
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)
        return generate_latest(reg)

    samples = {(n, what): [] for n in (LOW, HIGH) for what in ("refresh", "scrape")}
    for _ in range(args.rounds):
        for n in (LOW, HIGH):
            running.set(n)
            snap = offline.ledger.snapshot()
            assert snap.pools["req_to_token"].units_used == n and snap.pools["swa_kv"].units_used == n
            samples[(n, "refresh")] += timed(ks.refresh, args.reps)
            samples[(n, "scrape")] += timed(scrape, args.reps)
    text = scrape().decode()
    assert f'kvatlas_pool_used_slots{{dp_rank="0",engine="sglang",layer_kind="all",pool="request_slots"' in text
    figures = {}
    for what in ("refresh", "scrape"):
        lo, hi = (statistics.median(samples[(n, what)]) for n in (LOW, HIGH))
        figures[what] = {"median_16_ms": lo * 1e3, "median_1024_ms": hi * 1e3, "ratio": hi / lo,
                         "p90_1024_ms": statistics.quantiles(samples[(HIGH, what)], n=10)[-1] * 1e3}
        print(f"{what:8s} median {lo * 1e3:.3f} ms at {LOW}, {hi * 1e3:.3f} ms at {HIGH} running: "
              f"ratio {hi / lo:.2f} (target <= 1.5)")
    print(f"samples per scrape: {sum(1 for line in text.splitlines() if line.startswith('kvatlas_'))}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "sglang_scrape", "reps": args.reps, "rounds": args.rounds, "figures": figures}, f,
                      indent=2)


if __name__ == "__main__":
    main()
