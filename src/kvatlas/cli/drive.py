"""What `kvatlas serve` and `kvatlas simulate` share: workload options, building the cache, the
simulator and its writer, and the end-of-run summary."""

from __future__ import annotations

import argparse
import math
import os
import stat
import sys
from dataclasses import dataclass

from ..checks import MAX_COUNT, real, require_torch
from ..driving.sim import ADMISSION_WINDOW, HOLD_FOR_WRITERS
from ..driving.workload import MAX_DURATION_S, MAX_RATE_PER_S
from ..errors import BudgetError, ConfigError
from ..observing.table import render
from ..units import fmt_bytes
from .common import check_backend, count, number
from .runreport import run_rows


def add_workload_args(p) -> None:
    """The workload: synthetic or a trace (serve, simulate, tune)."""
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default="synthetic", help="synthetic (default) or a JSONL trace file: "
                   'kvatlas (one {"arrival_s", "prompt_tokens", "output_tokens"} per line) or Mooncake '
                   '(one {"timestamp" ms, "input_length", "output_length", "hash_ids"} per line)')
    g.add_argument("--trace-format", default="auto", choices=("auto", "kvatlas", "mooncake"),
                   help="format of the trace's lines (default auto: Mooncake when a line has its fields)")
    g.add_argument("--rate", type=number(0.0, MAX_RATE_PER_S, open_low=True), default=4.0,
                   help="synthetic: arrivals per second (Poisson, default 4)")
    g.add_argument("--duration", type=number(0.0, MAX_DURATION_S, open_low=True), default=10.0,
                   help="synthetic: seconds of arrivals (default 10)")
    g.add_argument("--prompt-len", default="uniform:64:1024",
                   help="synthetic prompt lengths: N, uniform:LO:HI, exp:MEAN, lognormal:MEDIAN:SIGMA")
    g.add_argument("--output-len", default="uniform:16:256", help="synthetic output lengths (same forms)")
    g.add_argument("--turns", default="1", help="synthetic: turns per session (same forms; default 1). Turn k's "
                   "prompt = turn k-1's prompt + its output + a follow-up; --rate then counts sessions")
    g.add_argument("--followup-len", default="uniform:16:256", help="synthetic: tokens a user adds per later turn")
    g.add_argument("--think", default="exp:5", help="synthetic: seconds from a turn's end to the next turn "
                   "(same forms, e.g. exp:5 or 0; default exp:5)")
    g.add_argument("--system-prompts", type=count(0, 1_000_000), default=0, help="synthetic: N distinct system prompts, one "
                   "opening every session (uniformly chosen), shared as a prefix (default 0: none)")
    g.add_argument("--system-prompt-len", default="2048", help="synthetic: system prompt lengths (same forms)")
    g.add_argument("--seed", type=count(0, 2**63 - 1), default=0, help="seed of arrivals, lengths and draft acceptance")
    g.add_argument("--strict-trace", action="store_true", help="a malformed trace line is fatal (default: skip it)")


def add_time_model_args(p) -> None:
    """What one forward pass costs (serve, simulate, tune)."""
    g = p.add_argument_group("time model (one forward pass = step + prefill × tokens + decode × tokens)")
    g.add_argument("--step-ms", type=number(0.0, 3.6e6, open_low=True), default=20.0,
                   help="fixed time of every forward pass (default 20 ms)")
    g.add_argument("--prefill-us-per-token", type=number(0.0, 1e9), default=40.0,
                   help="time per prompt token computed; cache hits are not computed (default 40 µs)")
    g.add_argument("--decode-us-per-token", type=number(0.0, 1e9), default=100.0,
                   help="time per token a decoding request writes (default 100 µs)")


def add_run_args(p) -> None:
    """How a real cache is driven (serve, simulate): drafts, KV writes, device, backend, checks."""
    g = p.add_argument_group("run")
    g.add_argument("--accept-rate", type=number(0.0, 1.0), default=0.7, help="probability each draft token is accepted")
    g.add_argument("--write-layers", default=None,
                   help="layers per pool that get real KV writes: N or 'all' (default: 1 on CPU, all on CUDA)")
    g.add_argument("--check-integrity", action="store_true", help="debug: compare the counters after every forward "
                   "pass and recount every book (allocator, ledger, prefix cache, host tier) after the first, the "
                   "last and as many passes between as the same CPU time again allows (at most about 2x the run's "
                   "CPU); a broken one stops the run as a bug (exit 1)")
    g.add_argument("--hold-for-writers", type=count(0, 1 << 20), default=HOLD_FOR_WRITERS, metavar="N",
                   help="cache-aware admission: a waiting request may be passed over for up to N passes while "
                        "running requests write the pages right past its cached prefix, the requests behind it "
                        f"admitted meanwhile (default {HOLD_FOR_WRITERS}; 0: first come, first served)")
    g.add_argument("--admission-window", type=count(0, 1 << 20), default=ADMISSION_WINDOW, metavar="W",
                   help="prefix-first admission: before each pass's admissions the first W waiting requests are "
                        "ordered by how many pages of their prompt the prefix cache holds, deepest first, as vLLM "
                        f"0.34's cache_aware_admission_window (default {ADMISSION_WINDOW}; 0: arrival order)")
    g.add_argument("--queue-aware-eviction", action=argparse.BooleanOptionalAction, default=True,
                   help="each arriving request is enqueued with the prefix cache, whose eviction then keeps the "
                        "pages waiting requests would hit while anything else is evictable, and of those takes "
                        "the one whose first reader waits furthest back first (default on; --no-queue-aware-"
                        "eviction: plain LRU with reuse credit, as before)")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    g.add_argument("--backend", default="plain", help="arena backend: plain (default), vmm (CUDA), or none: "
                   "allocator and ledger only, no pool tensors (any plan size; no KV writes)")


def add_drive_args(p) -> None:
    """Every flag `serve` and `simulate` share: the workload, the time model, the run, the tiers."""
    add_workload_args(p)
    add_time_model_args(p)
    add_run_args(p)
    add_tier_args(p)


def add_tier_args(p) -> None:
    """The host tier and the shared tier below it (serve, simulate)."""
    g = p.add_argument_group("host tier (under the prefix cache)")
    g.add_argument("--host-memory", default=None, help="bytes of host tier (e.g. 128GiB): pages and resume points "
                   "evicted from the device move there and come back before the request's first pass; the "
                   "simulator charges each move its modeled time (H200 bandwidth). Needs --prefix-checkpoints")
    g.add_argument("--host-checkpoint-share", type=number(0.0, 1.0), default=None,
                   help="share of the host tier's bytes for resume points, in [0, 1) (default 1/3)")
    g = p.add_argument_group("shared tier (under the host tier; every cache process of a deployment shares it)")
    g.add_argument("--shared-tier", default=None, metavar="URL",
                   help="a shared store below the host tier: mooncake://MASTER:PORT?metadata=http://HOST:PORT/metadata "
                        "or redis://HOST:PORT (or memory://NAME, in-process). Needs --host-memory. With --backend none "
                        "the store holds the real keys and headers, each payload zeros of 1/1024 of its bytes")
    g.add_argument("--shared-policy", default="finish", choices=("finish", "evict"),
                   help="finish (default): write through what a finish caches; evict: only what the host tier drops")
    g.add_argument("--shared-deadline-ms", type=number(0.0, 60_000.0, open_low=True), default=500.0,
                   help="deadline of every store call (default 500 ms); a call past it opens the breaker")
    g.add_argument("--shared-namespace", default="default", help="namespace of this deployment's keys (default 'default')")
    g.add_argument("--shared-startup-s", type=number(0.0, 600.0, open_low=True), default=5.0,
                   help="seconds to wait for the store at start-up (default 5): a store not open by then serves "
                        "misses (tier_unavailable) while it is tried again in the background, backing off to 30 s")
    p.set_defaults(rank=0, ranks_of=1, sample_ms=None)   # simulate --ranks' children and simulate set them


def requests_from_args(args) -> list:
    from ..driving import workload
    if args.workload == "synthetic":   # every session flag is checked, used or not: a typo is never ignored
        for flag, text, low in (("--turns", args.turns, 1), ("--followup-len", args.followup_len, 1),
                                ("--think", args.think, 0), ("--system-prompt-len", args.system_prompt_len, 1)):
            workload.parse_length(text, flag, minimum=low)
    if args.workload == "synthetic" and (args.turns.strip() != "1" or args.system_prompts != 0):
        from ..driving.sessions import sessions
        return sessions(rate_per_s=args.rate, duration_s=args.duration, turns=args.turns, first_len=args.prompt_len,
                        followup_len=args.followup_len, output=args.output_len, think=args.think,
                        system_prompts=args.system_prompts, system_len=args.system_prompt_len, seed=args.seed)
    if args.workload == "synthetic":
        return workload.synthetic(rate_per_s=args.rate, duration_s=args.duration,
                                  prompt=workload.parse_length(args.prompt_len, "--prompt-len"),
                                  output=workload.parse_length(args.output_len, "--output-len"), seed=args.seed)

    from ..driving import traces
    skipped = {"count": 0, "last": 0}   # counters, not a list: a file of garbage has many bad lines

    def report(line_no: int, problem: str) -> None:
        skipped["count"] += 1
        skipped["last"] = line_no
        if skipped["count"] <= _SHOWN_PROBLEMS:
            print(f"{args.workload}:{line_no}: skipped: {problem}", file=sys.stderr)

    reqs, _ = traces.read_trace(args.workload, fmt=args.trace_format, strict=args.strict_trace, on_error=report)
    if skipped["count"] > _SHOWN_PROBLEMS:
        print(f"{args.workload}: {skipped['count'] - _SHOWN_PROBLEMS:,} more lines skipped, the last on line "
              f"{skipped['last']}", file=sys.stderr)
    if not reqs:
        raise ConfigError("--workload", f"{args.workload!r} holds no request ({skipped['count']:,} lines skipped)",
                          "give a trace with at least one valid line")
    return reqs


_SHOWN_PROBLEMS = 20


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


@dataclass(frozen=True)
class Prepared:
    """What `build` needs, checked without blocking on anything: the workload (None: a pipe,
    read later), the plan, the host tier's bytes, the device and the layers to write."""
    time_model: object
    requests: list | None
    plan: object
    host_bytes: int | None
    layers: int | None


def workload_may_block(args) -> bool:
    """--workload names a pipe: reading it waits for its writer (anything else is read, or
    refused, at once)."""
    if args.workload == "synthetic":
        return False
    try:
        return stat.S_ISFIFO(os.stat(args.workload).st_mode)
    except OSError:
        return False     # (refused with the reason when it is read)


def read_requests(args) -> list:
    requests = requests_from_args(args)
    if args.ranks_of > 1:   # one rank of simulate --ranks: every ranks_of-th request, from this rank's
        from .ranks import deal
        requests = deal(requests, args.rank, args.ranks_of)
    return requests


def prepare(args, plan_from_args, *, defer_pipe: bool = False) -> Prepared:
    """Every check of the arguments that needs no server and no allocation; the workload is read
    here unless `defer_pipe` and it is a pipe (then `build` reads it)."""
    real("--accept-rate", args.accept_rate, 0.0, 1.0)
    tm = time_model(args)
    if args.backend == "none" and args.write_layers not in (None, "0"):
        raise ConfigError("--write-layers", f"{args.write_layers!r} with --backend none",
                          "drop --write-layers: the bookkeeping backend holds no rows to write")
    if args.rank >= args.ranks_of:
        raise ConfigError("--rank", f"{args.rank} is not a rank of --ranks-of {args.ranks_of}",
                          f"give 0 to {args.ranks_of - 1}")
    requests = None if defer_pipe and workload_may_block(args) else read_requests(args)
    p = plan_from_args(args)
    host_bytes = host_memory(args, p)
    if args.shared_tier is not None:
        if host_bytes is None:
            raise ConfigError("--shared-tier", "the shared tier sits below the host tier, and there is none",
                              "add --host-memory BYTES (and --prefix-checkpoints N)")
        from ..tiers.shared import check_shared_args, check_url
        check_url(args.shared_tier, "--shared-tier")   # the whole URL, before anything is allocated
        check_shared_args(args.shared_namespace, args.rank, args.shared_policy, args.shared_deadline_ms / 1e3)
    require_torch("allocating a cache")
    from ..cache.arena import parse_device
    device = parse_device(args.device)
    layers = write_layers(args, device)   # refused before the cache exists
    check_backend(args.backend, device)
    return Prepared(tm, requests, p, host_bytes, layers)


def build(args, plan_from_args, *, lock=None, record=True, prepared: Prepared | None = None):
    """(cache, simulator, writer) for the parsed arguments; the cache is allocated for real. The
    shared store (--shared-tier) is opened first, waiting at most --shared-startup-s."""
    pr = prepared if prepared is not None else prepare(args, plan_from_args)
    requests = pr.requests if pr.requests is not None else read_requests(args)
    store = open_shared(args) if args.shared_tier is not None else None
    try:
        import kvatlas
        from ..driving.sim import Simulator
        from ..driving.simwrite import KVWriter
        cache = kvatlas.allocate(pr.plan, device=args.device, backend=args.backend)
        layers = pr.layers if cache.arena.backend.holds_memory else 0
        host = attach_host(cache, pr.host_bytes, args, store) if pr.host_bytes is not None else None
    except BaseException:
        if store is not None:
            store.close()
        raise
    writer = KVWriter(cache, layers=layers, seed=args.seed) if layers != 0 else None
    sim = Simulator(cache, requests, accept_rate=args.accept_rate, seed=args.seed, writer=writer, lock=lock,
                    record=record, time_model=pr.time_model, sample_s=sample_s(args, requests), host=host,
                    check_integrity=args.check_integrity, hold_for_writers=args.hold_for_writers,
                    admission_window=args.admission_window, queue_aware_eviction=args.queue_aware_eviction)
    return cache, sim, writer


def open_shared(args):
    """--shared-tier's store, open or opening: waits at most --shared-startup-s; a store that
    answered and refused is a ConfigError (exit 2), one that did not answer yet a warning."""
    from ..tiers.shared import open_store
    store = open_store(args.shared_tier, "--shared-tier", startup_s=args.shared_startup_s,
                       startup_field="--shared-startup-s")
    if not store.ready:
        name = f"kvatlas {args.argv[0]}" if getattr(args, "argv", None) else "kvatlas"
        print(f"{name}: warning: --shared-tier: {store.describe()}; until it opens every read is a miss "
              "(tier_unavailable) and nothing is written", file=sys.stderr, flush=True)
    return store


def host_memory(args, plan) -> int | None:
    """--host-memory in bytes, checked against the plan before anything is allocated."""
    from ..planning.hostplan import plan_host
    from ..units import parse_bytes
    if args.host_memory is None:
        if args.host_checkpoint_share is not None:
            raise ConfigError("--host-checkpoint-share", "given without --host-memory", "add --host-memory BYTES")
        return None
    n = parse_bytes(args.host_memory, "--host-memory")
    if not plan.options.prefix_checkpoints:
        raise ConfigError("--host-memory", "the host tier holds what the prefix cache evicts, and the prefix "
                          "cache is off", "add --prefix-checkpoints N (N > 0) or drop --host-memory")
    try:
        host_plan = plan_host(plan, n, *([] if args.host_checkpoint_share is None else [args.host_checkpoint_share]))
    except ConfigError as exc:   # name the flag the user typed
        flag = "--host-checkpoint-share" if exc.field == "checkpoint_share" else "--host-memory"
        raise ConfigError(flag, exc.problem, exc.fix) from None
    except BudgetError as exc:   # too small for one page (and one checkpoint)
        raise BudgetError("--host-memory: " + str(exc).removeprefix("host_memory_bytes: ")) from None
    if args.backend == "none":   # modeled: no memory, but bookkeeping per slot
        from ..tiers.modeled import check_modeled_fits
        check_modeled_fits(host_plan)
    else:                        # pinned: it and, on the CPU, the pools themselves take host memory
        from ..tiers.memory import check_host_fits
        on_cpu = not str(args.device).startswith("cuda")
        check_host_fits(host_plan, beside_bytes=plan.total_bytes if on_cpu else 0)
    return n


def attach_host(cache, host_bytes: int, args, store=None):
    """The real pinned tier when the pools hold memory; the modeled one (no memory) with backend
    none; with --shared-tier, the shared store below it."""
    from ..tiers import HostLink, attach_host_tier
    from ..tiers.modeled import ModeledHost
    share = args.host_checkpoint_share
    opts = {} if share is None else {"checkpoint_share": share}
    if args.shared_tier is not None:
        return _attach_shared(cache, host_bytes, args, store if store is not None else open_shared(args), opts)
    if cache.arena.backend.holds_memory:
        return attach_host_tier(cache, host_bytes, **opts)
    link = HostLink(cache.prefix, ModeledHost(cache.plan, host_bytes, share))
    cache.host = link
    return link


def _attach_shared(cache, host_bytes: int, args, store, opts: dict):
    from ..tiers.modeled import ModeledHost
    from ..tiers.shared import attach_shared_tier, modeled_shared_link
    kw = dict(namespace=args.shared_namespace, policy=args.shared_policy, deadline_s=args.shared_deadline_ms / 1e3,
              writer=args.rank)
    if cache.arena.backend.holds_memory:
        return attach_shared_tier(cache, host_bytes, store, **kw, **opts)
    link = modeled_shared_link(cache.prefix, ModeledHost(cache.plan, host_bytes, args.host_checkpoint_share), store, **kw)
    cache.host = link
    return link


_TIME_FLAGS = {"pass_s": "--step-ms", "prefill_s_per_token": "--prefill-us-per-token",
               "decode_s_per_token": "--decode-us-per-token"}


def time_model(args):
    from ..driving.timemodel import TimeModel
    try:
        return TimeModel(pass_s=args.step_ms / 1e3, prefill_s_per_token=args.prefill_us_per_token / 1e6,
                         decode_s_per_token=args.decode_us_per_token / 1e6)
    except ConfigError as exc:   # name the flag the user typed
        raise ConfigError(_TIME_FLAGS[exc.field], exc.problem, exc.fix) from None


def sample_s(args, requests) -> float:
    """A long trace would otherwise put every pass (tens of thousands) on the timeline."""
    if args.sample_ms is not None:
        if not (math.isfinite(args.sample_ms) and args.sample_ms >= 0):
            raise ConfigError("--sample-ms", f"{args.sample_ms}", "give a finite number of milliseconds ≥ 0")
        return args.sample_ms / 1e3
    span = max((r.arrival_s for r in requests), default=0.0)
    return span / 2000


def replay_options(args, time_model) -> dict:
    """The Simulator's keyword arguments a fit's replays take from the command line: the run's own
    time model, draft acceptance, seed and admission."""
    return {"time_model": time_model, "accept_rate": args.accept_rate, "seed": args.seed,
            "hold_for_writers": args.hold_for_writers, "admission_window": args.admission_window,
            "queue_aware_eviction": args.queue_aware_eviction}


def check_record_served(args, flag: str, path: str | None) -> None:
    """A run asked to record what the prefix cache served (`flag`, writing `path`): refused before
    any work when the cache is off or the file cannot be written."""
    if not args.prefix_checkpoints:
        raise ConfigError(flag, "records what the prefix cache served, and it is off",
                          f"add --prefix-checkpoints N (or fit), or drop {flag}")
    if path is not None:
        from .common import check_output_file
        check_output_file(flag, path, extensions=None)


def record_served(cache, sim, max_requests: int) -> None:
    """From now on the cache keeps what it serves, its arrivals on the driver's clock."""
    cache.prefix.record(max_requests=max(max_requests, 1), clock=lambda: sim.now_s)


def write_served(cache, path: str) -> str:
    """The requests recorded (record_served) as a kvatlas trace at `path`: --workload replays it
    with the same sharing and --prefix-checkpoints fit fits to it."""
    from ..driving.traces import served_requests, write_trace
    write_trace(path, served_requests(cache.prefix.served()))
    return path


def summary(cache, sim, writer, wall_s: float, how: str) -> str:
    s, snap = sim.stats, cache.ledger.snapshot()
    addr = max(snap.addressable_bytes, 1)
    rows = [
        ["requests", f"{s.arrived} arrived, {s.admitted} admitted, {s.finished} finished, "
                     f"{s.rejected_too_long} rejected (longer than max_model_len), "
                     f"{len(sim.waiting) + len(sim.pending)} never admitted, {len(sim.running)} still running"],
        ["tokens", f"{s.prefill_tokens:,} prefilled, {s.decode_tokens:,} decoded "
                   f"({s.drafts_accepted:,} drafts accepted, {s.drafts_rejected:,} rolled back)"],
        ["forward passes", f"{s.steps:,} ({s.blocked_steps:,} with the queue head waiting for a slot or memory)"],
        ["peak", f"{s.peak_running} running, {fmt_bytes(s.peak_occupied_bytes)} occupied "
                 f"({100 * s.peak_occupied_bytes / addr:.1f}% of addressable)"],
        ["end", f"{snap.running_requests} running, {fmt_bytes(snap.occupied_bytes)} occupied "
                f"({snap.occupied_bytes:,} B)"],
        ["cache", _cache_line(cache, snap)],
        ["prefix cache", _prefix_line(cache)],
        ["host tier", _host_line(sim)],
        ["shared tier", _shared_line(sim)],
        ["KV writes", _writes(writer)],
        *run_rows(cache, sim),
        *([["integrity", f"{sim.integrity_recounts:,} whole recounts of every book over {s.steps:,} passes, the "
                          "counters compared after each; all exact"]] if sim.check_integrity else []),
        ["time model", sim.time_model.describe() + _host_model(sim)],
        ["wall time", f"{wall_s:.2f} s ({how})"],
    ]
    return render(["", "summary"], rows, title=f"kvatlas — {cache.plan.model.name}")


def _prefix_line(cache) -> str:
    if cache.prefix is None:
        return "off (plan with --prefix-checkpoints N to cache prompt prefixes)"
    s = cache.prefix.stats
    missed = ", ".join(f"{k} {v:,}" for k, v in s.missed().items())
    return (f"{s.why_not()}; {s.hit_tokens:,} of {s.queried_tokens:,} prompt tokens hit; missed: {missed}; "
            f"{s.evicted_pages:,} pages and {s.evicted_checkpoints:,} resume points evicted")


def _host_model(sim) -> str:
    if sim.host is None:
        return ""
    from ..tiers.modeled import COPY_CALL_S, OFFLOAD_BYTES_PER_S, RESTORE_BYTES_PER_S
    return (f"; host tier moves: bytes / {RESTORE_BYTES_PER_S / 1e9:g} GB/s to device, "
            f"/ {OFFLOAD_BYTES_PER_S / 1e9:g} GB/s to host (H200-measured) + {COPY_CALL_S * 1e6:g} µs per copy "
            "call, one after another; a restoring request's first pass waits for its restores")


def _host_line(sim) -> str:
    if sim.host is None:
        return "off (--host-memory BYTES with the prefix cache to keep evicted pages in host memory)"
    snap, hc, pc = sim.host.snapshot(), sim.host_clock, sim.cache.prefix.stats
    host_tokens = snap.hits["host_hit_tokens"]
    shared = sim.host.shared_snapshot()
    shared_tokens = shared.hit_tokens if shared is not None else 0
    return (f"{fmt_bytes(sim.host.tier.plan.budget_bytes)} ({'pinned' if sim.host.tier.memory_backed else 'modeled, no memory'}); "
            f"hit tokens by tier: device {pc.device_hit_tokens:,}, host {host_tokens:,}"
            + (f", shared {shared_tokens:,}" if shared is not None else "") + " "
            f"({snap.hits['host_hit_requests']:,} requests); moved to host {snap.bytes_to_host:,} B "
            f"({fmt_bytes(snap.bytes_to_host)}), to device {snap.bytes_to_device:,} B "
            f"({fmt_bytes(snap.bytes_to_device)}); modeled restore {hc.restore_s:.4f} s, offload "
            f"{sim.host.tier.modeled_seconds['host']:.4f} s; {hc.restoring:,} requests waited "
            f"{hc.wait_s:.4f} s in all from admission to first pass")


def _shared_line(sim) -> str:
    shared = sim.host.shared_snapshot() if sim.host is not None else None
    if shared is None:
        return "off (--shared-tier URL with --host-memory to share cached prefixes between processes)"
    hits, misses = shared.hits, shared.misses
    missed = {r: sum(m[r] for m in misses.values()) for r in next(iter(misses.values()))}
    why = ", ".join(f"{r} {n:,}" for r, n in missed.items() if n) or "none"
    return (f"{shared.store} ({'keys and headers; payloads modeled at 1/1024' if shared.modeled_payload else 'bytes'}, "
            f"policy {shared.policy}); hit tokens {shared.hit_tokens:,} ({shared.hit_requests:,} requests); "
            f"hits {hits['page']:,} pages, {hits['checkpoint']:,} resume points; misses: {why}; "
            f"to store {shared.moved_bytes['to_store']:,} B, from store {shared.moved_bytes['from_store']:,} B; "
            f"errors {sum(shared.errors.values()):,}; breaker {shared.breaker_state} "
            f"(opened {shared.breaker_opened:,} times)")


def _cache_line(cache, snap) -> str:
    if not cache.arena.backend.holds_memory:
        return (f"NO POOL TENSORS (backend none): allocator and ledger only; {fmt_bytes(snap.planned_bytes)} "
                f"planned, {fmt_bytes(snap.addressable_bytes)} addressable, 0 B allocated "
                "(tensor, reserved and physical are 0)")
    return (f"{fmt_bytes(snap.tensor_bytes)} tensor on {snap.device} ({snap.backend}), "
            f"{fmt_bytes(snap.addressable_bytes)} addressable")


def _writes(writer) -> str:
    if writer is None:
        return "none: allocator and ledger only"
    layers = writer.layers_written
    text = f"{writer.rows_written:,} rows stored through kvatlas.datapath; layers per pool: " + \
        ", ".join(f"{k} {v}" for k, v in layers.items())
    if writer.skipped:
        text += "; not written: " + ", ".join(writer.skipped)
    return text
