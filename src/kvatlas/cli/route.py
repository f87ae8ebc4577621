"""`kvatlas route`: an OpenAI-compatible router in front of N vLLM replicas, choosing for each
request the replica (and DP rank) whose KV cache resumes most of its prompt, from the replicas' own
KV events and DeepSeek-V4's hit rule, weighed against their load. SIGINT or SIGTERM stops it: the
listening socket closes, requests in flight get `--grace-s` to finish."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from ..errors import ConfigError
from .common import count, number

POLICIES = ("kvatlas", "round_robin", "least_loaded", "main_group_prefix")


def add_parser(p) -> None:
    p.add_argument("model", help="preset name, config.json or model directory (the model the replicas serve; a "
                   "directory holding the tokenizer also tokenizes text prompts)")
    p.add_argument("--replica", action="append", default=[], metavar="URL=EVENTS",
                   help="a replica: its OpenAI server and KV event endpoint, http://HOST:PORT=tcp://HOST:PORT "
                   "[,replay=tcp://HOST:PORT][,dp=N][,name=NAME]; once per replica")
    p.add_argument("--policy", choices=POLICIES, default="kvatlas", help="how to choose (default kvatlas)")
    p.add_argument("--weights", metavar="NAME=VALUE,...", help="cost weights in prefill tokens, the rest keep their "
                   "defaults: prefill_token, cpu_token, storage_token, in_flight_prefix, fork_prefix, in_flight, "
                   "running, waiting (e.g. waiting=2048,fork_prefix=0)")
    p.add_argument("--hold-s", type=number(0.0, 3600.0), default=60.0,
                   help="kvatlas policy: a request whose chosen replica is still computing a prompt it shares more of "
                   "than is resident there waits until the replica's events show that prefix (or the prompt ends), "
                   "at most this long, then goes with an exact prediction (default 60; 0 sends at once)")
    p.add_argument("--tokenizer", metavar="DIR", help="local directory with the model's tokenizer, for text prompts "
                   "and chat (default: MODEL when it is one)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=count(0, 65535), default=9500, help="TCP port (default 9500; 0 picks a free one)")
    g = p.add_argument_group("faults")
    g.add_argument("--first-byte-timeout-s", type=number(0.0, 86400.0, open_low=True), default=300.0,
                   help="a replica that sends nothing for this long is taken out and the request retried (default 300)")
    g.add_argument("--connect-timeout-s", type=number(0.0, 600.0, open_low=True), default=5.0,
                   help="connecting to a replica (default 5)")
    g.add_argument("--health-interval-s", type=number(0.0, 3600.0, open_low=True), default=2.0,
                   help="seconds between health checks of every replica (default 2)")
    g.add_argument("--stale-after-s", type=number(0.0, 3600.0, open_low=True), default=10.0,
                   help="a replica whose events lag this long (or stop while it serves) is scored from load alone "
                   "(default 10)")
    g.add_argument("--grace-s", type=number(0.0, 3600.0), default=5.0,
                   help="on SIGINT/SIGTERM, seconds requests in flight get to finish (default 5)")


def parse_weights(text: str | None):
    """--weights "waiting=2048,fork_prefix=0" → routing.Weights (None: the defaults)."""
    import dataclasses
    from ..routing.policy import Weights
    if text is None:
        return None
    names = [f.name for f in dataclasses.fields(Weights)]
    values = {}
    for pair in text.split(","):
        name, sep, value = pair.strip().partition("=")
        if not sep or name not in names:
            raise ConfigError("--weights", f"{pair.strip()!r} is not NAME=VALUE with NAME one of {', '.join(names)}",
                              "e.g. --weights waiting=2048,fork_prefix=0")
        try:
            values[name] = float(value)
        except ValueError:
            raise ConfigError("--weights", f"{name}={value!r} is not a number", f"e.g. {name}=0.5") from None
    return Weights(**values)


def build_router(args):
    """The Router for parsed arguments (also used by tests and the bench, without the socket)."""
    from ..routing.choose import Chooser
    from ..routing.replicas import parse_replicas
    from ..routing.server import Router
    from ..routing.tokenize import PromptTokenizer, has_tokenizer_files
    specs = parse_replicas(args.replica)
    tok_path = args.tokenizer
    if tok_path is None and has_tokenizer_files(args.model):
        tok_path = args.model
    tokenizer = PromptTokenizer(tok_path)
    chooser = Chooser(args.model, specs, args.policy, stale_after_s=args.stale_after_s,
                      weights=parse_weights(args.weights))
    return Router(model=_served_name(args.model), specs=specs, chooser=chooser, tokenizer=tokenizer,
                  policy=args.policy, first_byte_timeout_s=args.first_byte_timeout_s,
                  connect_timeout_s=args.connect_timeout_s, health_interval_s=args.health_interval_s,
                  health_timeout_s=min(args.health_interval_s, 5.0), hold_s=args.hold_s)


def _served_name(model: str) -> str:
    return os.path.basename(os.path.normpath(model)) if os.sep in model else model


ROUTE_SWITCH_INTERVAL_S = 0.0005


def run(args) -> int:
    from ..observing import server as obs
    warning = obs.check_host(args.host)
    if warning:
        print(f"kvatlas route: warning: {warning}", file=sys.stderr, flush=True)
    router = build_router(args)
    logging.basicConfig(level=logging.WARNING, format="kvatlas route: %(message)s")
    # The subscribers apply event batches on their threads; a request waiting on the GIL meanwhile
    # gets it back within this interval (Python's default, 5 ms, would be the router's p99 by itself)
    sys.setswitchinterval(ROUTE_SWITCH_INTERVAL_S)
    if os.environ.get("KVATLAS_ROUTE_LOOP", "uvloop") == "uvloop":
        try:
            import uvloop      # the routing extra installs it (not on Windows): less loop overhead a request
        except ImportError:
            pass
        else:
            return uvloop.run(_serve(router, args))
    return asyncio.run(_serve(router, args))


async def _serve(router, args) -> int:
    from aiohttp import web
    runner = web.AppRunner(router.app(), access_log=None, shutdown_timeout=args.grace_s,
                           handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise ConfigError("--port", f"cannot listen on {args.host}:{args.port} ({e.strerror or e})",
                          "give a free port, or 0 to pick one") from None
    port = site._server.sockets[0].getsockname()[1]
    stop = asyncio.Event()
    how = {"signal": None}
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda s=sig: (how.update(signal=s.name), stop.set()))
    names = ", ".join(f"{s.spec.name}={s.spec.url} (dp {s.spec.dp_size})" for s in router.states)
    print(f"kvatlas route: {router.model}, policy {router.policy}, {len(router.states)} replicas: {names}; "
          f"listening at http://{args.host}:{port} (/v1/completions /v1/chat/completions /v1/models /health "
          f"/score /state /metrics)", flush=True)
    await stop.wait()
    await runner.cleanup()
    print(f"kvatlas route: stopped by {how['signal']}; served {router.served}, retried {router.retried}, "
          f"unserved {router.unserved}", flush=True)
    return 130 if how["signal"] == "SIGINT" else 0
