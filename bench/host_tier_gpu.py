"""The host tier on one GPU (written for an H200): how fast do cached pages come back from
pinned host memory, and what do restores in flight cost the decode steps running beside them?

  (a) exactness: N V4-Flash pages of random bytes (and checkpoints) go to host and come back
      into other device pages, byte-identical (compared on the device).
  (b) restore bandwidth: N pages restored (all three FULL_PAGES buffers, through the staging
      buffer, on the copy stream) against a plain `copy_` of the same number of bytes from the
      same pinned slab into one device tensor, measured in the same run, interleaved, median of
      REPS. Two placements: host slots contiguous (a chain evicted together) and scattered (a
      random half of 2N resident pages). Also offload (device to host) against a plain D2H copy.
  (c) decode steps while restores are in flight: a CUDA graph of decode steps (the data path of
      a V4-Flash decode step for 1,024 requests: SWA store + window gather over 43 layers, the
      memory-bound part of attention) timed alone and while a restore of N pages runs on the
      copy stream (every timed step ends before the restore does; checked), interleaved, median.

Run: python bench/host_tier_gpu.py [--json FILE]   (needs CUDA; ~1 minute; pins HOST_BYTES)
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import kvatlas  # noqa: E402
from kvatlas import formats  # noqa: E402
from kvatlas.datapath import PageGeometry, gather, store  # noqa: E402
from kvatlas.tiers import CheckpointAt, HostTier  # noqa: E402

DEV = torch.device("cuda", 0)
DEVICE_BYTES, HOST_BYTES = "24GiB", "12GiB"
N_PAGES, REPS, DECODE, LAYERS, WINDOW = 3000, 7, 1024, 43, 128


def events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def fill_random(cache) -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    for r in cache.arena.regions.values():
        raw = r.tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=DEV, generator=g))


def page_bytes(cache, names, pages) -> list:
    idx = torch.as_tensor(pages, device=DEV)
    return [cache.arena.regions[n].tensor.index_select(0, idx) for n in names]


def exactness(cache, tier, rng) -> dict:
    names = [b.name for b in tier.plan.group_buffers("host_pages")]
    src = rng.choice(np.arange(1, cache.plan.num_full_pages), N_PAGES, replace=False)
    want = page_bytes(cache, names, src)
    tier.offload_pages([("x", int(p)) for p in src], src)
    for n in names:                                   # the pages are reused: scribble
        cache.arena.regions[n].tensor[torch.as_tensor(src, device=DEV)] = 0xA5
    dst = rng.permutation(src)
    t = tier.restore_pages([("x", int(p)) for p in src], dst)
    t.wait()                                          # compute stream waits; no host sync
    got = page_bytes(cache, names, dst)
    pages_ok = all(torch.equal(a, b) for a, b in zip(want, got))
    swa, st = cache.arena.regions["swa_kv"].tensor, cache.arena.regions["c4_state"].tensor
    at = [CheckpointAt(swa_pages=(1 + 2 * i, 2 + 2 * i), unit=1 + i, first_row=4) for i in range(8)]
    w_swa, w_st = swa[1:17].clone(), st[1:9, :, 4:8].clone()
    tier.offload_checkpoints(list(range(8)), at)
    swa[1:17] = 0
    st[1:9] = 0
    back = [CheckpointAt(swa_pages=(20 + 2 * i, 21 + 2 * i), unit=9 + i, first_row=4) for i in range(8)]
    tier.restore_checkpoints(list(range(8)), back).wait()
    ckpt_ok = torch.equal(swa[20:36], w_swa) and torch.equal(st[9:17, :, 4:8].view(torch.uint8), w_st.view(torch.uint8))
    tier.drop("page", tier.resident("page"))
    torch.cuda.synchronize()
    return {"pages": N_PAGES, "pages_identical": pages_ok, "checkpoints": 8, "checkpoints_identical": ckpt_ok,
            "pinned": tier.memory.pinned}


def timed(fn) -> float:
    torch.cuda.synchronize()
    a, b = events()
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3


def bandwidth(cache, tier, rng, scattered: bool) -> dict:
    """Median restore and offload seconds for N pages, and the plain copies of the same bytes."""
    free = np.arange(1, cache.plan.num_full_pages)
    total = 2 * N_PAGES if scattered else N_PAGES
    res, plain_h2d, off, plain_d2h = [], [], [], []
    nbytes = N_PAGES * tier.plan.unit_bytes("host_pages")
    scratch = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    slab = tier.memory.slab.narrow(0, 0, nbytes)
    for rep in range(REPS):
        pages = rng.choice(free, total, replace=False)
        keys = [("b", rep, int(p)) for p in pages]
        off.append(timed(lambda: tier.offload_pages(keys[:N_PAGES], pages[:N_PAGES]).transfer.synchronize()))
        if scattered:
            tier.offload_pages(keys[N_PAGES:], pages[N_PAGES:]).transfer.synchronize()
        pick = rng.permutation(total)[:N_PAGES]
        dst = rng.choice(free, N_PAGES, replace=False)
        plain_h2d.append(timed(lambda: scratch.copy_(slab, non_blocking=True)))
        t = tier.restore_pages([keys[i] for i in pick], dst)
        t.synchronize()
        res.append(t.latency_s)
        plain_d2h.append(timed(lambda: slab.copy_(scratch, non_blocking=True)))
        tier.drop("page", tier.resident("page"))
    med = statistics.median
    return {"placement": "scattered" if scattered else "contiguous", "pages": N_PAGES, "bytes": nbytes,
            "restore_s": med(res), "plain_h2d_s": med(plain_h2d), "restore_gbps": nbytes / med(res) / 1e9,
            "plain_h2d_gbps": nbytes / med(plain_h2d) / 1e9, "restore_vs_plain": med(plain_h2d) / med(res),
            "offload_s": med(off), "plain_d2h_s": med(plain_d2h), "offload_gbps": nbytes / med(off) / 1e9,
            "plain_d2h_gbps": nbytes / med(plain_d2h) / 1e9, "offload_vs_plain": med(plain_d2h) / med(off)}


def decode_graph(steps: int):
    """A CUDA graph of `steps` decode-step data paths: store one SWA row per request in every
    layer, then gather every request's 128-token window in every layer (bf16 out)."""
    fmt = formats.FP8_DS_MLA
    geom = PageGeometry(fmt, 64)
    pages_per_req = 3
    buf = torch.zeros(DECODE * pages_per_req + 1, LAYERS, geom.page_bytes, dtype=torch.uint8, device=DEV)
    base = 1 + torch.arange(DECODE, device=DEV) * pages_per_req
    new = base * 64 + WINDOW
    window = (base[:, None] * 64 + 1 + torch.arange(WINDOW, device=DEV)[None, :]).reshape(-1)
    x = torch.randn(LAYERS, DECODE, 512, device=DEV).bfloat16()
    layers = range(0, LAYERS)

    def step():
        store(geom, buf, layers, new, x, validate=False)
        gather(geom, buf, layers, window, validate=False)
    step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(steps):
            step()
    torch.cuda.synchronize()
    return g


def slowdown(cache, tier, rng) -> dict:
    steps = 4
    g = decode_graph(steps)
    for _ in range(3):
        g.replay()
    alone_s = timed(g.replay) / steps
    reps = max(1, int(0.6 * N_PAGES * tier.plan.unit_bytes("host_pages") / 50e9 / (alone_s * steps)))
    free = np.arange(1, cache.plan.num_full_pages)
    alone, busy, overlapped = [], [], []
    for rep in range(REPS):
        alone.append(timed(lambda: [g.replay() for _ in range(reps)]) / (reps * steps))
        pages = rng.choice(free, N_PAGES, replace=False)
        keys = [("s", rep, int(p)) for p in pages]
        tier.offload_pages(keys, pages).transfer.synchronize()
        dst = rng.choice(free, N_PAGES, replace=False)
        torch.cuda.synchronize()
        a, b = events()
        t = tier.restore_pages(keys, dst)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        busy.append(a.elapsed_time(b) / 1e3 / (reps * steps))
        overlapped.append(t._start.elapsed_time(b) <= t._start.elapsed_time(t._end))
    med = statistics.median
    return {"decode_step_alone_s": med(alone), "decode_step_with_restores_s": med(busy),
            "slowdown": med(busy) / med(alone), "steps_timed_per_rep": reps * steps,
            "every_timed_step_inside_a_restore": all(overlapped), "reps": REPS}


def main(json_path: str | None) -> None:
    rng = np.random.default_rng(0)
    plan = kvatlas.plan("deepseek-v4-flash", DEVICE_BYTES)
    cache = kvatlas.allocate(plan, device=DEV)
    fill_random(cache)
    tier = HostTier(cache, HOST_BYTES)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "device_plan": DEVICE_BYTES,
           "host_tier": HOST_BYTES, "host_plan": {k: v for k, v in tier.plan.to_dict().items() if k != "buffers"},
           "staging_bytes": tier.engine.staging_bytes}
    out["exactness"] = exactness(cache, tier, rng)
    print("exactness", out["exactness"], flush=True)
    out["bandwidth"] = [bandwidth(cache, tier, rng, s) for s in (False, True)]
    for r in out["bandwidth"]:
        print("bandwidth", {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    out["decode"] = slowdown(cache, tier, rng)
    print("decode", out["decode"], flush=True)
    out["host_snapshot"] = tier.snapshot().to_dict()
    tier.close()
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    main(ap.parse_args().json)
