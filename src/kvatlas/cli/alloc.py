"""`kvatlas alloc`: allocate a plan for real and show the ledger beside the plan (and, on CUDA,
beside torch's own allocator counters)."""

from __future__ import annotations

import json
import time

from ..checks import require_torch
from ..observing.table import render
from ..units import fmt_bytes
from .common import add_deployment_args, check_backend, plan_from_args

ALLOC_SCHEMA_VERSION = 1


def add_parser(p) -> None:
    add_deployment_args(p)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--backend", default="plain", help="arena backend: plain (default) or vmm (CUDA)")
    p.add_argument("--json", action="store_true", help="print the ledger snapshot and torch counters as JSON (schema kvatlas.alloc v1)")


def _torch_counters(device) -> dict:
    import torch

    from ..cache.arena import parse_device
    if parse_device(device).type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    return {"memory_allocated": torch.cuda.memory_allocated(device),
            "memory_reserved": torch.cuda.memory_reserved(device),
            "mem_get_info_free": torch.cuda.mem_get_info(device)[0]}


def run(args) -> int:
    p = plan_from_args(args)
    require_torch("kvatlas alloc")
    import kvatlas
    from ..cache.arena import parse_device
    check_backend(args.backend, parse_device(args.device))   # refused here, before anything is allocated
    before = _torch_counters(args.device)
    t0 = time.perf_counter()
    cache = kvatlas.allocate(p, device=args.device, backend=args.backend)
    seconds = time.perf_counter() - t0
    after = _torch_counters(args.device)
    snap = cache.check_integrity()
    growth = {k: after[k] - before[k] for k in after}
    if args.json:
        print(json.dumps({"schema": "kvatlas.alloc", "schema_version": ALLOC_SCHEMA_VERSION,
                          "plan_total_bytes": p.total_bytes, "allocate_seconds": seconds,
                          "ledger": snap.to_dict(), "torch_growth": growth}, indent=2))
        return 0
    rows = [[name, f"{u.measures.planned_bytes:,}", f"{u.measures.tensor_bytes:,}", f"{u.measures.reserved_bytes:,}",
             f"{u.measures.physical_bytes:,}", f"{u.measures.addressable_bytes:,}", f"{u.measures.occupied_bytes:,}"]
            for name, u in snap.pools.items()]
    t = snap
    rows.append(["total", f"{t.planned_bytes:,}", f"{t.tensor_bytes:,}", f"{t.reserved_bytes:,}",
                 f"{t.physical_bytes:,}", f"{t.addressable_bytes:,}", f"{t.occupied_bytes:,}"])
    print(f"kvatlas alloc — {p.model.name} on {cache.device} ({snap.backend} backend), "
          f"{fmt_bytes(p.total_bytes)} in {seconds * 1e3:.1f} ms")
    print(render(["pool", "planned", "tensor", "reserved", "physical", "addressable", "occupied"], rows))
    print(f"\nmem_usage_gib {snap.mem_usage_gib:.6f}  (planned == tensor: {snap.planned_bytes == snap.tensor_bytes})")
    if growth and snap.backend == "vmm":   # mapped through the driver: torch's counters never see it
        drop, torch_reserved = -growth["mem_get_info_free"], growth["memory_reserved"]
        rest = drop - snap.physical_bytes - torch_reserved
        print(f"mem_get_info() free memory fell {drop:,} B = ledger physical {snap.physical_bytes:,} B "
              f"(mapped of {snap.reserved_bytes:,} B reserved address space) + torch's caching allocator "
              f"{torch_reserved:,} B" + (f" + {rest:,} B outside both (driver, context)" if rest else ""))
    elif growth:
        print(f"torch.cuda.memory_allocated() grew {growth['memory_allocated']:,} B "
              f"(ledger tensor {snap.tensor_bytes:,} B, ratio {growth['memory_allocated'] / snap.tensor_bytes:.6f})")
        print(f"torch.cuda.memory_reserved()  grew {growth['memory_reserved']:,} B "
              f"(ledger reserved {snap.reserved_bytes:,} B)")
    return 0
