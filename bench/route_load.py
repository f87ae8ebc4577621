"""kvatlas route under load (issue 37), loopback only, bounded in time and count.

Four fake vLLM replicas that answer at once (tests/route_fake.py: OpenAI HTTP, DeepSeek-V4 KV
events on ZMQ) and `kvatlas route` in front, each its own process. In one run:

1. time to first byte, one client, requests one after another, alternating direct-to-a-replica and
   through the router on the same prompts: the router's added p50 and p99 (paired: each routed
   request has a direct twin sent just before it), after `--ttfb-warmup` pairs (default 200);
2. throughput: 64 concurrent clients for `--seconds`, through the router, then the same 64 clients
   for the same time straight to the replicas (round robin): requests/s of each and their ratio;
3. the router's resident memory (VmRSS) sampled every second during its run: first sample after
   warm-up, last, max; and its CPU time (all threads: the HTTP loop and the event subscribers) per
   request over the run, a figure that other jobs on the machine inflate far less than latency.

Prompts are token ids (1024 tokens: one of 16 shared 768-token prefixes + a unique tail), so the
router tokenizes nothing but predicts and scores every request against the replicas' events.

    python bench/route_load.py [--seconds 20] [--clients 64] [--ttfb-requests 400] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from route_fleet import Fake, Router, get   # noqa: E402


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 120000) for _ in range(768)] for _ in range(16)]
    return [prefixes[i % 16] + [rng.randrange(10, 120000) for _ in range(256)] for i in range(n)]


def cpu_s(pid: int) -> float:
    """The process's CPU time so far (user + system, all its threads), seconds."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def ttfb(session, url: str, ids) -> float:
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 1}) as r:
        await r.content.readany()
        t = time.perf_counter() - t0
        await r.read()
        assert r.status == 200, r.status
    return t


async def paired_ttfb(router_url: str, direct: list[str], n: int, warmup: int = 200) -> dict:
    import aiohttp
    ps = prompts(n, seed=1)
    d, r = [], []
    async with aiohttp.ClientSession() as s:
        # warm-up: connections, caches, the processes' allocators (a first round of 400 pairs after 20
        # read ~0.15 ms slower on both sides than the rounds after it)
        for i in range(warmup):
            ids = ps[i % len(ps)][:-1] + [100_000 + i]
            await ttfb(s, router_url, ids)
            await ttfb(s, direct[i % len(direct)], ids)
        for i, ids in enumerate(ps):
            ids = ids[:-1] + [7 + i]
            d.append(await ttfb(s, direct[i % len(direct)], ids))
            r.append(await ttfb(s, router_url, ids[:-2] + [9 + i, 11]))
    added = sorted(b - a for a, b in zip(d, r))
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]
    return {"requests": n, "direct_p50_ms": 1e3 * q(d, 0.5), "direct_p99_ms": 1e3 * q(d, 0.99),
            "router_p50_ms": 1e3 * q(r, 0.5), "router_p99_ms": 1e3 * q(r, 0.99),
            "added_p50_ms": 1e3 * (q(r, 0.5) - q(d, 0.5)), "added_p99_ms": 1e3 * (q(r, 0.99) - q(d, 0.99)),
            "paired_added_median_ms": 1e3 * statistics.median(added)}


async def load(urls: list[str], clients: int, seconds: float, pid: int | None) -> dict:
    import aiohttp
    ps = prompts(512, seed=2)
    stop_at = time.monotonic() + seconds
    done = [0]
    errors = [0]
    mem = []

    async def client(c: int) -> None:
        i = c
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
            while time.monotonic() < stop_at:
                url = urls[i % len(urls)]
                async with s.post(url + "/v1/completions", json={"model": "m", "prompt": ps[i % len(ps)],
                                                                 "max_tokens": 1}) as r:
                    await r.read()
                    if r.status == 200:
                        done[0] += 1
                    else:
                        errors[0] += 1
                i += clients

    async def sampler() -> None:
        while time.monotonic() < stop_at:
            mem.append(rss_kib(pid))
            await asyncio.sleep(1.0)

    t0 = time.monotonic()
    cpu0 = cpu_s(pid) if pid else None
    tasks = [client(c) for c in range(clients)] + ([sampler()] if pid else [])
    await asyncio.gather(*tasks)
    wall = time.monotonic() - t0
    out = {"clients": clients, "seconds": wall, "requests": done[0], "errors": errors[0], "rps": done[0] / wall}
    if pid:     # what the router spends a request, all its threads: robust to a box others load
        out["cpu_ms_per_request"] = 1e3 * (cpu_s(pid) - cpu0) / max(done[0], 1)
    if mem:
        warm = mem[min(2, len(mem) - 1)]
        out.update(rss_first_kib=warm, rss_last_kib=mem[-1], rss_max_kib=max(mem[2:] or mem),
                   rss_samples=len(mem), rss_kib_every_s=mem)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--ttfb-requests", type=int, default=400)
    p.add_argument("--ttfb-warmup", type=int, default=200, help="request pairs sent before the timed ones")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--json")
    args = p.parse_args()
    assert 1 <= args.clients <= 256 and 0 < args.seconds <= 120 and args.ttfb_requests <= 5000
    fakes = [Fake(f"r{i}", stream_chunks=1, capacity_blocks=100000) for i in range(args.replicas)]
    router = None
    try:
        for f in fakes:
            f.start()
        router = Router([f.replica_flag() for f in fakes], "--health-interval-s", "1")
        direct = [f.url for f in fakes]
        res = {"ttfb": asyncio.run(paired_ttfb(router.url, direct, args.ttfb_requests, args.ttfb_warmup))}
        res["router"] = asyncio.run(load([router.url], args.clients, args.seconds, router.proc.pid))
        res["direct"] = asyncio.run(load(direct, args.clients, args.seconds, None))
        res["throughput_ratio"] = res["router"]["rps"] / res["direct"]["rps"]
        state = get(router.url + "/state")
        res["router_requests"] = state["requests"]
    finally:
        if router is not None:
            router.stop()
        for f in fakes:
            f.stop()
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()
