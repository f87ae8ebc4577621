"""GPU allocation check (issue 3): for V4-Flash and V4-Pro planned at 120 GiB, the ledger's
tensor bytes against the growth of torch.cuda.memory_allocated() (target ratio 1.000000),
reserved against memory_reserved(), and kvatlas.allocate() wall time against one plain
torch.empty of the same total bytes, both measured in the same fresh process.

    python bench/alloc_gpu.py [--memory 120GiB] [--repeats 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

MODELS = ("deepseek-v4-flash", "deepseek-v4-pro")


def measure(model: str, memory: str, repeats: int) -> dict:
    import torch

    import kvatlas
    p = kvatlas.plan(model, memory)
    torch.cuda.init()
    torch.cuda.synchronize()
    a0, r0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    t = time.perf_counter()
    cache = kvatlas.allocate(p, device="cuda")
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    da, dr = torch.cuda.memory_allocated() - a0, torch.cuda.memory_reserved() - r0
    snap = cache.check_integrity()
    audit = kvatlas.audit(cache).total_bytes
    out = {"model": model, "plan_total_bytes": p.total_bytes, "ledger_tensor_bytes": snap.tensor_bytes,
           "ledger_reserved_bytes": snap.reserved_bytes, "audit_bytes": audit,
           "memory_allocated_growth": da, "memory_reserved_growth": dr,
           "tensor_over_allocated": snap.tensor_bytes / da, "reserved_over_reserved": snap.reserved_bytes / dr}
    cache.close()
    del cache
    torch.cuda.empty_cache()
    ours, plain = [first], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        x = torch.empty(p.total_bytes, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        plain.append(time.perf_counter() - t)
        del x
        torch.cuda.empty_cache()
        t = time.perf_counter()
        c = kvatlas.allocate(p, device="cuda")
        torch.cuda.synchronize()
        ours.append(time.perf_counter() - t)
        c.close()
        del c
        torch.cuda.empty_cache()
    out.update(allocate_seconds_median=statistics.median(ours), torch_empty_seconds_median=statistics.median(plain),
               allocate_over_empty=statistics.median(ours) / statistics.median(plain), repeats=repeats)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--memory", default="120GiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.memory, args.repeats)))
        return
    results = []
    for model in MODELS:  # a fresh process each: a fresh caching allocator
        r = subprocess.run([sys.executable, __file__, "--one", model, "--memory", args.memory,
                            "--repeats", str(args.repeats)], capture_output=True, text=True)
        if r.returncode:
            print(r.stdout, r.stderr, file=sys.stderr)
            raise SystemExit(r.returncode)
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
    for r in results:
        print(f"{r['model']:18s} plan {r['plan_total_bytes']:,} B | ledger tensor / memory_allocated growth "
              f"{r['tensor_over_allocated']:.6f} | ledger reserved / memory_reserved growth "
              f"{r['reserved_over_reserved']:.6f} | audit {r['audit_bytes']:,} B | allocate "
              f"{r['allocate_seconds_median'] * 1e3:.2f} ms vs torch.empty {r['torch_empty_seconds_median'] * 1e3:.2f} ms "
              f"({r['allocate_over_empty']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
