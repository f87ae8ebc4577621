"""`kvatlas serve`: allocate a real cache, drive it with a workload in real time, and serve
/metrics, /state and /healthz while it runs. The endpoints and the signal handlers come first:
/healthz answers ("starting: ...") while a --workload pipe is read, the shared store opened (at
most --shared-startup-s; a store not open by then serves misses, `tier_unavailable`, while it is
tried again in the background) and the cache allocated; /metrics and /state answer 503 until
the cache exists. SIGINT (Ctrl-C) or SIGTERM stops it cleanly in every phase: the pass
in progress completes, the socket is closed, and the summary is printed. The exit status then
says how it ended: 0 when the workload finished or SIGTERM asked it to stop (the way a service
manager stops a service), 130 after SIGINT (an interrupted command, as the shell reports one)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from ..errors import ConfigError
from ..units import fmt_bytes
from . import EXIT_INTERRUPTED
from .common import add_deployment_args, count, counts_arg, number, options_from_args, plan_from_args
from .drive import (add_drive_args, build, check_record_served, record_served, replay_options, summary,
                    write_served)


def add_parser(p) -> None:
    add_deployment_args(p)
    add_drive_args(p)
    g = p.add_argument_group("endpoints")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: loopback only)")
    g.add_argument("--port", type=count(0, 65535), default=9400, help="TCP port (default 9400; 0 picks a free one)")
    g.add_argument("--linger", type=_linger, default=0.0,
                   help="seconds to keep serving after the workload ends (default 0; -1: until a signal)")
    g.add_argument("--progress-s", type=number(0.0, 3600.0, open_low=True), default=1.0,
                   help="seconds between progress updates")
    g = p.add_argument_group("output")
    g.add_argument("--record-served", default=None, metavar="PATH",
                   help="when it stops, write what the prefix cache served to PATH (JSONL): a trace that --workload "
                        "replays with the same sharing and `simulate --prefix-checkpoints fit` fits the resume-point "
                        "count to, for the next start (the latest --record-max requests; needs the prefix cache)")
    g.add_argument("--record-max", type=count(1, 10_000_000), default=100_000, metavar="N",
                   help="requests --record-served and --refit-every keep, the latest (default 100000)")
    g.add_argument("--refit-every", type=count(1, 10_000_000), default=None, metavar="N",
                   help="every N requests served, fit the resume-point count to the latest --record-max served "
                        "(kvatlas.driving.refit: each share replayed beside the count running now, in a process of "
                        "its own); the latest fit is in /state (prefix_fit), on stderr and in the summary. The count "
                        "applies at the next start (needs the prefix cache)")
    g.add_argument("--refit-running", type=counts_arg, default=None, metavar="N,N,...",
                   help="with --refit-every: fit --max-running-requests too, among these counts and the one running "
                        "(each slot's fixed state comes out of the budget): the most hits among those whose mean time to "
                        "first token is within --refit-ttft-slack of the lowest")
    g.add_argument("--refit-ttft-slack", type=number(0.0, 1e6), default=None, metavar="F",
                   help="with --refit-running: how much more mean TTFT than the lowest a count may cost, as a "
                        "fraction (default 0.1: 10%%)")


def _linger(text: str) -> float:
    """Seconds to linger: a finite number ≥ 0, or exactly -1 (until a signal)."""
    if text.strip() == "-1":
        return -1.0
    return number(0.0, 1e7)(text)


_linger.__name__ = "seconds"


class _Stop:
    """SIGINT/SIGTERM set an event the driver checks between passes, so a pass is never cut
    half-way; a second SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason = ""
        self._old = {}
        self.builder: threading.Thread | None = None   # the start-up thread, while it runs

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.event.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name
        self.event.set()

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


class _Progress:
    """A live line on a terminal (rich), plain lines otherwise (logs, pipes)."""

    def __init__(self, every_s: float) -> None:
        self.every_s, self.last = every_s, 0.0
        self.live = None
        if sys.stdout.isatty():
            from rich.live import Live
            self.live = Live("", refresh_per_second=4, transient=False)
            self.live.start()

    def update(self, sim, now_s: float, force: bool = False) -> None:
        if not force and now_s - self.last < self.every_s:
            return
        self.last = now_s
        snap = sim.cache.ledger.snapshot()   # the driver's own thread: never mid-pass
        share = 100 * snap.occupied_bytes / max(snap.addressable_bytes, 1)
        line = (f"t={now_s:7.1f}s  running {len(sim.running):4d}  waiting {len(sim.waiting):4d}  "
                f"finished {sim.stats.finished:5d}  occupied {fmt_bytes(snap.occupied_bytes):>10} ({share:5.1f}%)  "
                f"passes {sim.stats.steps}")
        if self.live is not None:
            self.live.update(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


def _state(sim, refit):
    """/state's workload view: the simulator's, and the latest refit's (--refit-every)."""
    if refit is None:
        return sim.state
    return lambda: {**sim.state(), "prefix_fit": refit.state()}


def _drive(sim, args, stop: _Stop, progress: _Progress, refit=None) -> str:
    t0 = time.monotonic()
    done_at = None
    fits = 0
    while not stop.event.is_set():
        now = time.monotonic() - t0
        if refit is not None:   # (between passes: a fit ended is taken, one is begun when due)
            refit.poll()
            if refit.fits > fits:
                fits = refit.fits
                print(f"kvatlas serve: resume points fitted {refit.line()}", file=sys.stderr, flush=True)
        if sim.done:
            done_at = now if done_at is None else done_at
            progress.update(sim, now)
            if args.linger >= 0 and now - done_at >= args.linger:
                return "workload finished"
            stop.event.wait(min(0.2, args.linger if args.linger > 0 else 0.2))
            continue
        sim.step(now)
        progress.update(sim, now)
        wait = sim.last_pass_s - (time.monotonic() - t0 - now)   # paced by the time model
        if not (sim.running or sim.waiting) and sim.next_arrival_s is not None:
            wait = sim.next_arrival_s - (time.monotonic() - t0)
        if wait > 0:
            stop.event.wait(min(wait, 0.5))
    return f"stopped by {stop.reason}"


def _start(args, prepared, lock, stop: _Stop, handle):
    """Build on a thread of its own (reading a --workload pipe, opening the shared store,
    allocating) while this thread waits for it or a signal: (cache, sim, writer), or None when
    a signal came first. An error of the build is raised here."""
    out: dict = {}

    def work() -> None:
        try:
            out["built"] = build(args, plan_from_args, lock=lock, record=False, prepared=prepared)
        except BaseException as exc:   # noqa: BLE001 (raised again on the waiting thread)
            out["error"] = exc
        finally:
            done.set()

    done = threading.Event()
    stop.builder = threading.Thread(target=work, name="kvatlas-serve-start", daemon=True)
    stop.builder.start()
    while not (done.is_set() or stop.event.is_set()):
        done.wait(0.1)
    if "error" in out:
        raise out["error"]
    return out.get("built")


def _leave(code: int, stop: _Stop) -> int:
    """A stop during start-up leaves the start-up thread where it is (reading a pipe, waiting on
    a store, or inside torch allocating the cache): the process ends at once, its summary printed.
    Returning would let the interpreter's exit kill that thread mid-call, and a thread killed
    inside torch's C++ aborts the process (SIGABRT) instead of exiting with `code`."""
    if stop.builder is not None and stop.builder.is_alive():
        store = sys.modules.get("kvatlas.tiers.shared.store")
        if store is not None:       # os._exit skips atexit: a store probe would outlive us
            store.kill_probes()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def run(args) -> int:
    from ..observing import server
    from .drive import prepare
    warning = server.check_host(args.host)   # refused before anything is planned or allocated
    if warning:
        print(f"kvatlas serve: warning: {warning}", file=sys.stderr, flush=True)
    lock = server.FairLock()   # scrapes wait for the pass in progress, not for a gap between passes
    t0 = time.monotonic()
    progress = refit = None
    with _Stop() as stop:      # signals first: SIGTERM stops it cleanly in every phase
        # every check that cannot block, before the port is taken: bad input is refused first
        prepared = prepare(args, plan_from_args, defer_pipe=True)
        if args.record_served is not None:
            check_record_served(args, "--record-served", args.record_served)
        if args.refit_every is not None:
            check_record_served(args, "--refit-every", None)
        if args.refit_running is not None and args.refit_every is None:
            raise ConfigError("--refit-running", "weighs what the refit tries, and it is off",
                              "give it with --refit-every, or drop it")
        if args.refit_ttft_slack is not None and args.refit_running is None:
            raise ConfigError("--refit-ttft-slack", "weighs what the refit tries, and it is off",
                              "give it with --refit-running, or drop it")
        if stop.event.is_set():
            print(_not_started(args, "checking the arguments", time.monotonic() - t0, stop), flush=True)
            return EXIT_INTERRUPTED if stop.reason == "SIGINT" else 0
        steps = (["reading the workload"] if prepared.requests is None else []) + \
            ([f"opening the shared store (at most {args.shared_startup_s:g} s)"] if args.shared_tier else []) + \
            ["allocating the cache"]
        handle = server.start_pending(args.host, args.port, phase=", then ".join(steps))
        try:
            print(f"kvatlas serve: starting; {handle.url}/healthz answers now, /metrics and /state once the cache "
                  "is built", file=sys.stderr, flush=True)
            built = _start(args, prepared, lock, stop, handle)
            if built is None:
                phase = handle.phase
                handle.close()
                print(_not_started(args, phase, time.monotonic() - t0, stop), flush=True)
                return _leave(EXIT_INTERRUPTED if stop.reason == "SIGINT" else 0, stop)
            cache, sim, writer = built
            if args.record_served is not None or args.refit_every is not None:
                record_served(cache, sim, args.record_max)
            if args.refit_every is not None:
                from ..driving.refit import Refit
                refit = Refit(cache, args.model, options_from_args(args, prefix_checkpoints=0),
                              every=args.refit_every, simulator=replay_options(args, prepared.time_model),
                              running=args.refit_running, **({} if args.refit_ttft_slack is None
                                                              else {"ttft_slack": args.refit_ttft_slack}))
            handle.attach(cache, lock=lock, extra_state=_state(sim, refit), request_state=sim.progress)
            print(f"kvatlas serve: {cache.plan.model.name}, {fmt_bytes(cache.plan.total_bytes)} on {cache.device}; "
                  f"{len(sim.pending)} requests; endpoints at {handle.url}/metrics /state /healthz", flush=True)
            progress = _Progress(args.progress_s)
            how = _drive(sim, args, stop, progress, refit)
        finally:
            if refit is not None:
                refit.close()
            if progress is not None:
                progress.close()
            handle.close()
    if sim.done:
        with lock:
            cache.check_integrity()
    print(summary(cache, sim, writer, time.monotonic() - t0, how + "; endpoint closed"), flush=True)
    if refit is not None:
        print(f"resume points fitted again: {refit.line()}", flush=True)
    if args.record_served is not None:
        print(f"\nwritten: {write_served(cache, args.record_served)} ({len(cache.prefix.served()):,} requests "
              "served)", flush=True)
    return EXIT_INTERRUPTED if stop.reason == "SIGINT" else 0


def _not_started(args, phase: str, wall_s: float, stop: _Stop) -> str:
    """The summary of a run stopped before its cache existed."""
    from ..observing.table import render
    from ..tiers.shared.store import redact
    rows = [["phase", f"stopped while {phase}: nothing ran"], ["workload", args.workload],
            ["shared tier", redact(args.shared_tier) if args.shared_tier is not None else "off"],
            ["wall time", f"{wall_s:.2f} s (stopped by {stop.reason} while starting; endpoint closed)"]]
    return render(["", "summary"], rows, title="kvatlas serve")
