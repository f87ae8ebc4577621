"""The vmm backend's bookkeeping cost per decode step, on CPU: the workload of bench/vmm_gpu.py
part (c) — V4-Flash, a 40 GiB plan, max_model_len 8192, 1,024 running requests, one token each
per step, a finished request replaced by a new one outside the timed region — run through the
allocator twice in the same process, interleaved step by step:

  plain: Allocator(plan) with no backing (LIFO free lists), as the plain backend runs it;
  vmm:   Allocator(plan, backing=ChunkMap(...)) over a bookkeeping-only stand-in driver whose
         map/unmap record the chunk and cost ~0 (no host memory behind it), so the difference
         is the vmm bookkeeping alone: lowest-first free lists, chunk refcounts, cap checks.

Reports the median µs per allocator step of each side, the ratio (target ≤ 1.10×), and how
many chunks the vmm side mapped / unmapped during the timed steps.

    python bench/vmm_step_cpu.py [--requests 1024] [--steps 300] [--runs 3] [--chunk-bytes 2MiB]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import kvatlas  # noqa: E402
from decode_workload import start_request  # noqa: E402
from kvatlas.alloc import Allocator  # noqa: E402
from kvatlas.cache.ledger import Ledger  # noqa: E402
from kvatlas.units import parse_bytes  # noqa: E402
from kvatlas.vmm import ChunkLayout, ChunkMap, StandInDriver  # noqa: E402

MODEL = "deepseek-v4-flash"


class CountingDriver(StandInDriver):
    """The stand-in without its host memory: map/unmap only record the chunk (a 40 GiB plan
    does not fit in host RAM, and poisoning 2 MiB per map would swamp the bookkeeping)."""

    label = "counting stand-in (CPU bench, no memory)"

    def reserve(self, nbytes: int) -> None:
        self.reserved = nbytes

    def map(self, offset: int, nbytes: int) -> None:
        if offset in self._mapped:
            raise RuntimeError(f"chunk at {offset} mapped twice")
        self.map_calls += 1
        self._mapped[offset] = nbytes

    def unmap(self, offset: int, nbytes: int) -> None:
        if self._mapped.pop(offset, None) != nbytes:
            raise RuntimeError(f"unmap of {nbytes} B at {offset} that is not mapped")
        self.unmap_calls += 1

    def tensor(self):
        return None


class _NoArena:
    pass


def build(plan, vmm: bool, chunk_bytes: int):
    backing = None
    if vmm:
        layout = ChunkLayout(plan.buffers, chunk_bytes)
        backing = ChunkMap(layout, CountingDriver(granularity=chunk_bytes))
        backing.pin(np.union1d(layout.pinned_chunks(), [0]).astype(np.int64))
    return Allocator(plan, Ledger(plan, _NoArena()), backing=backing)


class Decoder:
    """bench/vmm_gpu.py part (c)'s Decoder, on the allocator alone."""

    def __init__(self, alloc: Allocator, seed: int, requests: int) -> None:
        self.a, self.rng, self.requests = alloc, np.random.default_rng(seed), requests
        self.end, self.next_id = {}, 0
        while len(self.end) < requests:
            self.start_one()

    def start_one(self) -> None:
        self.end[self.next_id] = start_request(self.a, self.next_id, self.rng)
        self.next_id += 1

    def step(self) -> float:
        rids = list(self.end)
        t0 = time.perf_counter()
        self.a.step(rids, 1)
        t = time.perf_counter() - t0
        self.turnover()
        return t

    def turnover(self) -> None:
        a = self.a
        done = [r for r, end in self.end.items() if a.length[a.slot_of[r]] >= end]
        for r in done:
            a.finish(r)
            del self.end[r]
        while len(self.end) < self.requests and a.can_admit(1500, 512):
            self.start_one()


def run(plan, requests: int, warm: int, steps: int, chunk_bytes: int) -> dict:
    dp = Decoder(build(plan, False, chunk_bytes), 1, requests)
    dv = Decoder(build(plan, True, chunk_bytes), 1, requests)
    cm = dv.a.backing
    for _ in range(warm):
        dp.step(), dv.step()
    maps0, unmaps0 = cm.map_calls, cm.unmap_calls
    tp, tv = [], []
    for _ in range(steps):   # interleaved: the same machine state for both
        tp.append(dp.step())
        tv.append(dv.step())
    problems = cm.problems({g: fl.live_ids() for g, fl in
                            (("request_slots", dv.a.slots), ("full_pages", dv.a.full), ("swa_pages", dv.a.swa))
                            if fl is not None})
    if problems:
        raise AssertionError(problems)
    mp, mv = statistics.median(tp) * 1e6, statistics.median(tv) * 1e6
    return {"plain_us": mp, "vmm_us": mv, "ratio": mv / mp, "maps": cm.map_calls - maps0,
            "unmaps": cm.unmap_calls - unmaps0, "physical": cm.physical_bytes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--warm", type=int, default=60)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--memory", default="40GiB")
    ap.add_argument("--chunk-bytes", default="2MiB")
    args = ap.parse_args()
    chunk_bytes = parse_bytes(args.chunk_bytes, "chunk_bytes")
    plan = kvatlas.plan(MODEL, args.memory, max_running_requests=args.requests, max_model_len=8192)
    print(f"{MODEL} {args.memory}, {args.requests} requests, {args.steps} timed steps, chunks {args.chunk_bytes}; "
          "allocator step only, plain vs vmm (counting stand-in), interleaved")
    ratios = []
    for i in range(args.runs):
        r = run(plan, args.requests, args.warm, args.steps, chunk_bytes)
        ratios.append(r["ratio"])
        print(f"run {i}: plain {r['plain_us']:7.1f} µs   vmm {r['vmm_us']:7.1f} µs   ratio {r['ratio']:.3f}×   "
              f"maps {r['maps']} unmaps {r['unmaps']}   physical {r['physical'] / 2**30:.2f} GiB")
    print(f"median ratio {statistics.median(ratios):.3f}× (target ≤ 1.10×)")


if __name__ == "__main__":
    main()
