"""`kvatlas audit --sglang`: SGLang's own DeepSeek-V4 pools, built offline on the CPU, mapped buffer by
buffer (for sizing a deployment without a GPU). Needs SGLang 0.5.23 installed beside kvatlas."""

from __future__ import annotations

import json

from ..errors import ConfigError
from ..observing.table import render
from ..units import parse_bytes
from .common import count


def add_parser(p) -> None:
    p.add_argument("model", nargs="?", default="deepseek-v4-flash",
                   help="preset name, config.json or model directory (default: deepseek-v4-flash)")
    p.add_argument("--sglang", action="store_true", required=True,
                   help="build the pools with SGLang's own configurator (the only engine audited offline)")
    p.add_argument("--memory", required=True, help="the KV budget SGLang sizes from, e.g. 120GiB")
    p.add_argument("--max-running-requests", type=count(1), default=256,
                   help="SGLang --max-running-requests (default 256)")
    p.add_argument("--chunked-prefill-tokens", type=count(1), default=8192,
                   help="SGLang --chunked-prefill-size (default 8192)")
    p.add_argument("--swa-mode", choices=("ratio", "cap"), default="ratio",
                   help="ratio: what a V4 launch gets (default); cap: the ratio marked as not set by the operator")
    p.add_argument("--context-length", type=count(1), help="SGLang --context-length (default: the model's)")
    p.add_argument("--json", action="store_true", help="print the ledger and every storage as JSON")


def run(args) -> int:
    if args.max_running_requests < 1:
        raise ConfigError("max_running_requests", f"must be >= 1, got {args.max_running_requests}", "pass 1 or more")
    try:
        from ..integrations.sglang import plugin as ks
    except ImportError as exc:   # pragma: no cover - the module itself imports only the stdlib
        raise ConfigError("sglang", f"the integration cannot load ({exc})", "pip install 'kvatlas[sglang]'") from None
    offline = ks.build_offline(args.model, parse_bytes(args.memory), max_running_requests=args.max_running_requests,
                               chunked_prefill_tokens=args.chunked_prefill_tokens, swa_mode=args.swa_mode,
                               context_length=args.context_length)
    ledger = offline.ledger
    print(json.dumps(to_dict(ledger), indent=2) if args.json else text_report(ledger))
    return 0


def text_report(ledger) -> str:
    snap = ledger.snapshot()
    rows = []
    for b in ledger.buffers:
        m = snap.pools[b.name].measures
        rows.append([b.name, b.layout.spec.role, b.layout.spec.layer_kind, len(b.layout.spec.layers) or "-",
                     b.storages, f"{m.tensor_bytes:,}", f"{m.planned_bytes:,}", f"{m.addressable_bytes:,}",
                     f"{b.unreachable_bytes:,}", "yes" if b.in_kv_cache else "no"])
    head = ["pool", "role", "kind", "layers", "tensors", "tensor B", "planned B", "addressable B", "unreachable B",
            "in mem_usage"]
    kv = snap.kv_cache
    from ..integrations.sglang.plugin import SUPPORTED_VERSION
    title = f"SGLang {SUPPORTED_VERSION} DeepSeek-V4 pools, built offline by its own configurator"
    lines = [render(head, rows, title=title),
             "", f"KV pool (mem_usage): {kv.tensor_bytes:,} B = {kv.tensor_bytes / 2**30:.6f} GB "
                 f"(SGLang 0.5.23 itself reports 0)"]
    if ledger.budget_bytes is not None:
        lines.append(f"budget {ledger.budget_bytes:,} B; pools sized from it hold "
                     f"{ledger.budget_bytes + ledger.over_budget_bytes:,} B: {ledger.over_budget_bytes:,} B over")
    lines.append(f"unreachable by any index: {ledger.unreachable_bytes:,} B; beside the KV pool: "
                 f"{snap.total.tensor_bytes - kv.tensor_bytes:,} B (request table, free lists)")
    return "\n".join(lines)


def to_dict(ledger) -> dict:
    from ..integrations.sglang.plugin import layer_of
    layers = {b.name: b.layout.spec.layers for b in ledger.buffers}
    doc = ledger.snapshot().to_dict()
    doc["storages"] = [{**e.to_dict(), "pool": _pool_of(e.path),
                        "layer": layer_of(e.path, layers.get(_pool_of(e.path), ()))}
                       for e in ledger.audit_report.entries]
    return doc


def _pool_of(path: str) -> str:
    from ..integrations.sglang.plugin import _root_of
    return _root_of(path)
