"""The vmm backend on one GPU (written for an H200): is the ledger's physical figure what the
device really lost, what does a map cost, what does lazy backing add to a decode step, and how
much memory does a 10%-full 120 GiB V4-Flash cache really hold?

  (a) exactness: a 20 GiB plan grows to 80% of its full pages and shrinks to 5%; at every
      checkpoint the drop of torch.cuda.mem_get_info() free memory (minus what torch's own
      caching allocator reserved meanwhile) must equal the ledger's physical bytes; a request's
      data written at the start reads back unchanged after others mapped and unmapped chunks.
  (b) map / unmap latency per 2-MiB chunk (cuMemCreate + cuMemMap + cuMemSetAccess; cuMemUnmap).
  (c) decode step, vmm vs plain, same run, interleaved: allocator step (incl. any map calls) +
      an index_copy of the step's tokens into every layer of the SWA pool + synchronize; one
      vmm cache per chunk size (CHUNKS: 2 MiB and 8 MiB), all three stepped in turn.
  (d) physical bytes at 10% occupancy of a V4-Flash plan for 120 GiB, vmm vs plain, per chunk size.

Run: python bench/vmm_gpu.py   (needs CUDA, torch, cuda-python; ~1-2 minutes)
--json FILE writes every figure there. Each part reports its own error and the rest still run.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import kvatlas  # noqa: E402
from decode_workload import prefill, start_request  # noqa: E402
from kvatlas.units import GIB, fmt_bytes  # noqa: E402

DEV = torch.device("cuda", 0)
MODEL = "deepseek-v4-flash"
MIB = 1 << 20
CHUNKS = (2 * MIB, 8 * MIB)   # chunk_bytes compared in (c) and (d); (a) and (b) use the default (2 MiB)


# ------------------------------------------------------------------ helpers
class DeviceMeter:
    """Free device memory, less what torch's caching allocator took meanwhile: what the vmm
    driver mapped (torch's counters never see it)."""

    def __init__(self) -> None:
        torch.cuda.synchronize(DEV)
        self.free0, _ = torch.cuda.mem_get_info(DEV)
        self.torch0 = torch.cuda.memory_reserved(DEV)

    def mapped_bytes(self) -> tuple[int, int]:
        torch.cuda.synchronize(DEV)
        free, _ = torch.cuda.mem_get_info(DEV)
        torch_growth = torch.cuda.memory_reserved(DEV) - self.torch0
        return self.free0 - free - torch_growth, torch_growth


def release(*caches) -> None:
    for c in caches:
        if c is not None:
            c.close()
    gc.collect()
    torch.cuda.synchronize(DEV)
    torch.cuda.empty_cache()


def full_used(cache) -> int:
    return cache.allocator.full.used


def pages_of(cache, rid) -> np.ndarray:
    a = cache.allocator
    s = a.slot_of[rid]
    return a.full_table[s, : a.full_held[s]].copy()


# ------------------------------------------------------------------ (a) exactness
def part_a() -> dict:
    p = kvatlas.plan(MODEL, "20GiB", max_running_requests=128, max_model_len=131072, chunked_prefill_tokens=8192)
    meter = DeviceMeter()
    cache = kvatlas.allocate(p, device=DEV, backend="vmm")
    try:
        return _grow_and_shrink(cache, meter)
    finally:
        release(cache)


def _grow_and_shrink(cache, meter) -> dict:
    p = cache.plan
    rng = np.random.default_rng(0)
    capacity = p.num_full_pages - 1
    checks, worst, live = [], 0, []
    c4 = cache.pools["c4_kv"].tensor

    def checkpoint(phase):
        nonlocal worst
        snap = cache.check_integrity()
        dropped, torch_growth = meter.mapped_bytes()
        diff = dropped - snap.physical_bytes
        worst = max(worst, abs(diff))
        checks.append({"phase": phase, "occupancy": full_used(cache) / capacity, "physical": snap.physical_bytes,
                       "free_drop": dropped, "torch_growth": torch_growth, "diff": diff})

    checkpoint("start")
    # request 0: its pages get a pattern now, checked after everything else came and went
    cache.admit("keep", 16384)
    prefill(cache, "keep", 16384)
    keep_pages = pages_of(cache, "keep")
    c4[torch.from_numpy(keep_pages).to(DEV)] = 0x3C
    checkpoint("keep written")
    n = 0
    while full_used(cache) < 0.80 * capacity:
        tokens = int(rng.integers(8192, 65536))
        if not cache.can_admit(tokens):
            break
        cache.admit(n, tokens)
        prefill(cache, n, tokens)
        c4[torch.from_numpy(pages_of(cache, n)).to(DEV)] = 1 + n % 200   # touch what was mapped
        live.append(n)
        n += 1
        checkpoint("grow")
    peak = full_used(cache) / capacity
    rng.shuffle(live)
    while live and full_used(cache) > 0.05 * capacity:
        cache.finish(live.pop())
        checkpoint("shrink")
    cache.arena.backend.trim()
    checkpoint("trim")
    torch.cuda.synchronize(DEV)
    intact = bool(torch.all(c4[torch.from_numpy(keep_pages).to(DEV)] == 0x3C))
    others_intact = all(bool(torch.all(c4[torch.from_numpy(pages_of(cache, r)).to(DEV)] == 1 + r % 200))
                        for r in live)
    cm = cache.arena.backend.chunks
    out = {"plan_bytes": p.total_bytes, "checkpoints": len(checks), "peak_occupancy": peak,
           "final_occupancy": full_used(cache) / capacity, "max_abs_diff_bytes": worst,
           "exact": worst == 0, "data_intact": intact and others_intact, "map_calls": cm.map_calls,
           "unmap_calls": cm.unmap_calls, "map_us_per_chunk_in_workload": 1e6 * cm.map_seconds / max(cm.map_calls, 1),
           "trace": checks[:: max(len(checks) // 40, 1)]}
    cache.close()
    release()
    out["after_close_drop_bytes"] = meter.mapped_bytes()[0]   # everything given back: 0
    return out


# ------------------------------------------------------------------ (b) map latency
def part_b(chunks: int = 512) -> dict:
    from kvatlas.vmm.driver import CudaDriver
    drv = CudaDriver(DEV)
    g = drv.granularity
    drv.reserve(chunks * g)
    maps, unmaps = [], []
    try:
        for i in range(chunks):
            t = time.perf_counter()
            drv.map(i * g, g)
            maps.append(time.perf_counter() - t)
        for i in range(chunks):
            t = time.perf_counter()
            drv.unmap(i * g, g)
            unmaps.append(time.perf_counter() - t)
    finally:
        drv.close()
    m, u = np.array(maps) * 1e6, np.array(unmaps) * 1e6
    return {"granularity": g, "chunks": chunks, "map_us_median": float(np.median(m)),
            "map_us_p90": float(np.percentile(m, 90)), "unmap_us_median": float(np.median(u)),
            "unmap_us_p90": float(np.percentile(u, 90))}


# ------------------------------------------------------------------ (c) decode step
class Decoder:
    """1,024 running requests; a request that reaches its length finishes and a new one takes
    its place (outside the timed region), so the footprint stays roughly level."""

    def __init__(self, cache, seed: int, requests: int) -> None:
        self.cache, self.rng, self.requests = cache, np.random.default_rng(seed), requests
        swa = cache.pools["swa_kv"]
        self.rows_per_page = swa.spec.unit_bytes // 576          # 576-B rows: entry data of one layer
        self.layer_rows = swa.spec.unit_bytes // len(swa.layers) // 576
        self.rows = swa.tensor.view(-1, 576)
        self.layer_off = (torch.arange(len(swa.layers), device=DEV) * self.layer_rows).view(1, -1)
        self.Ps = cache.plan.options.swa_page_tokens
        self.src = torch.full((requests * len(swa.layers), 576), 7, dtype=torch.uint8, device=DEV)
        self.end, self.next_id = {}, 0
        while len(self.end) < requests:
            self.start_one()

    def start_one(self) -> None:
        self.end[self.next_id] = start_request(self.cache, self.next_id, self.rng)
        self.next_id += 1

    def step(self) -> tuple[float, float]:
        """One timed decode step: (allocator seconds, whole step seconds incl. the store)."""
        rids = list(self.end)
        torch.cuda.synchronize(DEV)
        t0 = time.perf_counter()
        w = self.cache.step(rids, 1)
        t1 = time.perf_counter()
        slots = torch.from_numpy(w.swa_slots).to(DEV, non_blocking=True)
        base = (slots // self.Ps) * self.rows_per_page + slots % self.Ps
        idx = (base.view(-1, 1) + self.layer_off).view(-1)
        self.rows.index_copy_(0, idx, self.src[: idx.numel()])
        torch.cuda.synchronize(DEV)
        t2 = time.perf_counter()
        self.turnover()
        return t1 - t0, t2 - t0

    def turnover(self) -> None:
        a = self.cache.allocator
        done = [r for r, end in self.end.items() if a.length[a.slot_of[r]] >= end]
        for r in done:
            self.cache.finish(r)
            del self.end[r]
        while len(self.end) < self.requests and self.cache.can_admit(1500, 512):
            self.start_one()


def part_c(warm: int = 60, steps: int = 300, requests: int = 1024, memory: str = "40GiB",
           chunks=CHUNKS) -> dict:
    p = kvatlas.plan(MODEL, memory, max_running_requests=requests, max_model_len=8192)
    caches = [kvatlas.allocate(p, device=DEV, backend="plain")]
    try:
        for cb in chunks:
            caches.append(kvatlas.allocate(p, device=DEV, backend="vmm", chunk_bytes=cb))
        decoders = [Decoder(c, 1, requests) for c in caches]
        cms = [c.arena.backend.chunks for c in caches[1:]]
        for _ in range(warm):
            for d in decoders:
                d.step()
        before = [(cm.map_calls, cm.unmap_calls) for cm in cms]
        times = [[] for _ in decoders]
        for _ in range(steps):   # interleaved: the same GPU and CPU state for all
            for d, t in zip(decoders, times):
                t.append(d.step())
        tp = np.array(times[0]) * 1e6
        out = {"plan_bytes": p.total_bytes, "requests": requests, "steps": steps,
               "plain_alloc_us": float(np.median(tp[:, 0])), "plain_step_us": float(np.median(tp[:, 1])), "rows": {}}
        for cb, cache, cm, t, (m0, u0) in zip(chunks, caches[1:], cms, times[1:], before):
            tv = np.array(t) * 1e6
            row = {"chunk_bytes": cb, "vmm_alloc_us": float(np.median(tv[:, 0])),
                   "vmm_step_us": float(np.median(tv[:, 1])),
                   "maps_during_timed_steps": cm.map_calls - m0, "unmaps_during_timed_steps": cm.unmap_calls - u0,
                   "map_us_per_chunk_in_workload": 1e6 * cm.map_seconds / max(cm.map_calls, 1),
                   "vmm_physical_bytes": cache.ledger.snapshot().physical_bytes}
            row["ratio_step"] = row["vmm_step_us"] / out["plain_step_us"]
            row["ratio_alloc"] = row["vmm_alloc_us"] / out["plain_alloc_us"]
            row["ratio_step_p90"] = float(np.percentile(tv[:, 1], 90) / np.percentile(tp[:, 1], 90))
            out["rows"][fmt_bytes(cb)] = row
        return out
    finally:
        release(*caches)


# ------------------------------------------------------------------ (d) 10% occupancy of 120 GiB
def part_d(memory: str = "120GiB", chunks=CHUNKS, **options) -> dict:
    p = kvatlas.plan(MODEL, memory, **options)
    plain = kvatlas.allocate(p, device=DEV, backend="plain")
    plain_physical = plain.ledger.snapshot().physical_bytes
    release(plain)
    plain = None
    out = {"plan_bytes": p.total_bytes, "plain_physical_bytes": plain_physical, "rows": {}}
    for cb in chunks:
        out["rows"][fmt_bytes(cb)] = _occupancy(p, cb, plain_physical)
    return out


def _occupancy(p, chunk_bytes: int, plain_physical: int) -> dict:
    meter = DeviceMeter()
    cache = kvatlas.allocate(p, device=DEV, backend="vmm", chunk_bytes=chunk_bytes)
    try:
        n = 0
        while cache.ledger.snapshot().occupied_bytes < 0.10 * p.total_bytes:
            tokens = 32768
            cache.admit(n, tokens)
            prefill(cache, n, tokens)
            n += 1
        snap = cache.check_integrity()
        dropped, _ = meter.mapped_bytes()
        return {"chunk_bytes": chunk_bytes, "requests": n, "occupied_bytes": snap.occupied_bytes,
                "occupancy": snap.occupied_bytes / snap.tensor_bytes, "vmm_physical_bytes": snap.physical_bytes,
                "vmm_free_drop_bytes": dropped, "exact": dropped == snap.physical_bytes,
                "reserved_bytes": snap.reserved_bytes, "ratio": snap.physical_bytes / plain_physical}
    finally:
        release(cache)


# ------------------------------------------------------------------ report
def run_part(name, fn, results) -> None:
    t = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as exc:   # one part failing must not hide the others
        results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        print(f"[{name}] FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
    release()   # outside the except: its frames (and any cache in them) are gone by now
    results[name]["seconds"] = time.perf_counter() - t


def table(r: dict) -> None:
    rows = []
    a, b, c, d = (r.get(k) or {"error": "not run"} for k in "abcd")
    if "error" not in a:
        rows += [("(a) free-memory drop == ledger physical", f"{a['checkpoints']} checkpoints, max |diff| "
                  f"{a['max_abs_diff_bytes']} B", "exact" if a["exact"] else "NOT EXACT"),
                 ("(a) occupancy peak → final", f"{a['peak_occupancy']:.0%} → {a['final_occupancy']:.0%}", ""),
                 ("(a) data written first reads back", str(a["data_intact"]), "ok" if a["data_intact"] else "LOST")]
    if "error" not in b:
        rows += [("(b) map per chunk (median / p90)", f"{b['map_us_median']:.1f} / {b['map_us_p90']:.1f} µs",
                  fmt_bytes(b["granularity"])),
                 ("(b) unmap per chunk (median / p90)", f"{b['unmap_us_median']:.1f} / {b['unmap_us_p90']:.1f} µs", "")]
    if "error" not in c:
        for label, row in c["rows"].items():
            rows += [(f"(c) {label} chunks: decode step plain / vmm", f"{c['plain_step_us']:.1f} / "
                      f"{row['vmm_step_us']:.1f} µs", f"{row['ratio_step']:.3f}× (target ≤ 1.10)"),
                     (f"(c) {label} chunks: allocator only plain / vmm", f"{c['plain_alloc_us']:.1f} / "
                      f"{row['vmm_alloc_us']:.1f} µs", f"{row['ratio_alloc']:.3f}×"),
                     (f"(c) {label} chunks: maps / unmaps in timed steps", f"{row['maps_during_timed_steps']} / "
                      f"{row['unmaps_during_timed_steps']}", f"{row['map_us_per_chunk_in_workload']:.1f} µs per map")]
    if "error" not in d:
        for label, row in d["rows"].items():
            rows += [(f"(d) {label} chunks: physical at 10% occupancy, 120 GiB",
                      f"{fmt_bytes(row['vmm_physical_bytes'])} vs plain {fmt_bytes(d['plain_physical_bytes'])}",
                      f"{row['ratio']:.1%} (target ≤ 15%)" + ("" if row["exact"] else ", free-memory drop differs"))]
    width = max(len(x[0]) for x in rows) if rows else 0
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:<40}  {note}")
    for k in "abcd":
        if "error" in (r.get(k) or {"error": "not run"}):
            print(f"({k}) ERROR {(r.get(k) or {}).get('error', 'not run')}")


def main() -> int:
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.zeros(1, device=DEV)
    results = {"device": torch.cuda.get_device_name(DEV), "torch": torch.__version__,
               "total_bytes": torch.cuda.mem_get_info(DEV)[1]}
    for name, fn in (("b", part_b), ("a", part_a), ("c", part_c), ("d", part_d)):
        run_part(name, fn, results)
    print(f"kvatlas vmm on {results['device']} (torch {results['torch']}, {results['total_bytes'] / GIB:.1f} GiB)")
    table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=lambda o: o.item() if hasattr(o, "item") else str(o))
        print(f"wrote {args.json}")
    return 0 if all("error" not in results[k] for k in "abcd") else 1


if __name__ == "__main__":
    sys.exit(main())
