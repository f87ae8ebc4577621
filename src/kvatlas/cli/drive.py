"""What `kvatlas serve` and `kvatlas simulate` share: workload options, building the cache, the
simulator and its writer, and the end-of-run summary."""

from __future__ import annotations

import sys

from ..checks import MAX_COUNT, real, require_torch
from ..errors import ConfigError
from ..driving.workload import MAX_DURATION_S, MAX_RATE_PER_S
from .common import count, number
from ..observing.table import render
from ..units import fmt_bytes


def add_workload_args(p) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default="synthetic", help="synthetic (default) or a JSONL trace file "
                   '(one {"arrival_s", "prompt_tokens", "output_tokens"} per line)')
    g.add_argument("--rate", type=number(0.0, MAX_RATE_PER_S, open_low=True), default=4.0, help="synthetic: arrivals per second (Poisson, default 4)")
    g.add_argument("--duration", type=number(0.0, MAX_DURATION_S, open_low=True), default=10.0, help="synthetic: seconds of arrivals (default 10)")
    g.add_argument("--prompt-len", default="uniform:64:1024",
                   help="synthetic prompt lengths: N, uniform:LO:HI, exp:MEAN, lognormal:MEDIAN:SIGMA")
    g.add_argument("--output-len", default="uniform:16:256", help="synthetic output lengths (same forms)")
    g.add_argument("--seed", type=count(0, 2**63 - 1), default=0, help="seed of arrivals, lengths and draft acceptance")
    g.add_argument("--strict-trace", action="store_true", help="a malformed trace line is fatal (default: skip it)")
    g.add_argument("--accept-rate", type=number(0.0, 1.0), default=0.7, help="probability each draft token is accepted")
    g.add_argument("--step-ms", type=number(0.0, 3.6e6, open_low=True), default=20.0, help="time of one forward pass (default 20 ms)")
    g.add_argument("--write-layers", default=None,
                   help="layers per pool that get real KV writes: N or 'all' (default: 1 on CPU, all on CUDA)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--backend", default="plain", help="arena backend: plain (default) or vmm (CUDA)")


def requests_from_args(args) -> list:
    from ..driving import workload
    if args.workload == "synthetic":
        return workload.synthetic(rate_per_s=args.rate, duration_s=args.duration,
                                  prompt=workload.parse_length(args.prompt_len, "--prompt-len"),
                                  output=workload.parse_length(args.output_len, "--output-len"), seed=args.seed)

    def report(line_no: int, problem: str) -> None:
        print(f"{args.workload}:{line_no}: skipped: {problem}", file=sys.stderr)

    try:
        reqs, _ = workload.read_trace(args.workload, strict=args.strict_trace, on_error=report)
    except UnicodeDecodeError as exc:   # the reader reads text: a binary file fails while decoding
        raise ConfigError("--workload", f"{args.workload!r} is not UTF-8 text (byte {exc.start})",
                          "give a JSONL trace file") from None
    return reqs


def write_layers(args, device) -> int | None:
    """None means every layer."""
    value = args.write_layers
    if value is None:
        return None if device.type == "cuda" else 1
    if value == "all":
        return None
    try:
        n = int(value)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_COUNT:
        raise ConfigError("--write-layers", f"{value!r}", "give a whole number ≥ 0 or 'all'")
    return n


def build(args, plan_from_args, *, lock=None, record=True):
    """(cache, simulator, writer) for the parsed arguments; the cache is allocated for real."""
    real("--accept-rate", args.accept_rate, 0.0, 1.0)
    real("--step-ms", args.step_ms, 0.0, 3.6e6, open_low=True)
    requests = requests_from_args(args)
    p = plan_from_args(args)
    require_torch("allocating a cache")
    import kvatlas
    from ..cache.arena import backend_factory, parse_device
    layers = write_layers(args, parse_device(args.device))   # refused before the cache exists
    backend_factory(args.backend)
    from ..driving.sim import Simulator
    from ..driving.simwrite import KVWriter
    cache = kvatlas.allocate(p, device=args.device, backend=args.backend)
    writer = KVWriter(cache, layers=layers, seed=args.seed) if layers != 0 else None
    sim = Simulator(cache, requests, accept_rate=args.accept_rate, seed=args.seed, writer=writer, lock=lock,
                    step_s=args.step_ms / 1e3, record=record)
    return cache, sim, writer


def summary(cache, sim, writer, wall_s: float, how: str) -> str:
    s, snap = sim.stats, cache.ledger.snapshot()
    addr = max(snap.addressable_bytes, 1)
    rows = [
        ["requests", f"{s.arrived} arrived, {s.admitted} admitted, {s.finished} finished, "
                     f"{s.rejected_too_long} rejected (longer than max_model_len), "
                     f"{len(sim.waiting) + len(sim.pending)} never admitted, {len(sim.running)} still running"],
        ["tokens", f"{s.prefill_tokens:,} prefilled, {s.decode_tokens:,} decoded "
                   f"({s.drafts_accepted:,} drafts accepted, {s.drafts_rejected:,} rolled back)"],
        ["forward passes", f"{s.steps:,} ({s.blocked_steps:,} with the queue head waiting for memory)"],
        ["peak", f"{s.peak_running} running, {fmt_bytes(s.peak_occupied_bytes)} occupied "
                 f"({100 * s.peak_occupied_bytes / addr:.1f}% of addressable)"],
        ["end", f"{snap.running_requests} running, {fmt_bytes(snap.occupied_bytes)} occupied "
                f"({snap.occupied_bytes:,} B)"],
        ["cache", f"{fmt_bytes(snap.tensor_bytes)} tensor on {snap.device} ({snap.backend}), "
                  f"{fmt_bytes(snap.addressable_bytes)} addressable"],
        ["KV writes", _writes(writer)],
        ["wall time", f"{wall_s:.2f} s ({how})"],
    ]
    return render(["", "summary"], rows, title=f"kvatlas — {cache.plan.model.name}")


def _writes(writer) -> str:
    if writer is None:
        return "none (--write-layers 0): allocator and ledger only"
    layers = writer.layers_written
    text = f"{writer.rows_written:,} rows stored through kvatlas.datapath; layers per pool: " + \
        ", ".join(f"{k} {v}" for k, v in layers.items())
    if writer.skipped:
        text += "; not written: " + ", ".join(writer.skipped)
    return text
