"""The replicas behind `kvatlas route`: what the operator named (`ReplicaSpec`, parsed from
`--replica`), and what the router learns of each while it runs (`ReplicaState`: up or out and why,
requests in flight through the router, running and waiting as the replica's own /metrics reports
them), kept current by `HealthChecker`.

A replica is taken out when a request to it fails before its first byte (connection refused, reset,
a first-byte timeout, a 5xx) and by a failed health check; only a health check brings it back: its
`/health` answers 200 (and its `/metrics`, when it serves vLLM's, gives its load). After a request
failure it is held out at least one health interval, doubled for each failure in a row (at most 30
s), since a replica whose /health answers while its completions hang would otherwise cost one
timeout per health interval. A replica taken
out still gets a request when every replica is out (the last resort beats refusing the client).

`--replica` syntax: `HTTP_URL[=EVENTS][,replay=REPLAY][,dp=N][,name=NAME][,bind]`. EVENTS is the ZMQ
endpoint the engine publishes KV events on (vLLM's `KVEventsConfig.endpoint`, `tcp://host:port`), REPLAY
its replay endpoint. vLLM's publisher binds when its endpoint has a wildcard host (`tcp://*:5557`)
and connects when it names one; for the latter, `bind` makes the router bind EVENTS (an address of the
router's own) for the engine to connect to; with N data-parallel ranks, rank r publishes on port + r and answers replays on
replay port + r (vLLM offsets both by the rank), and a request is pinned to a rank with vLLM's
`X-data-parallel-rank` header. `HTTP_URL` alone (no `=`) routes by load only: no events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import urllib.parse

from ..errors import ConfigError

MAX_DP_RANKS = 1024


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RankSpec:
    """One data-parallel rank of a replica: where its events and replays come from."""
    dp_rank: int
    events_endpoint: str | None
    replay_endpoint: str | None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaSpec:
    name: str
    url: str                      # base URL, no trailing slash: http://host:8000
    ranks: tuple[RankSpec, ...]
    bind: bool = False            # the router binds the events endpoints; the engines connect

    @property
    def dp_size(self) -> int:
        return len(self.ranks)


def _endpoint(text: str, field: str) -> tuple[str, int]:
    """(host, port) of tcp://host:port."""
    u = urllib.parse.urlsplit(text)
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme != "tcp" or not u.hostname or port is None or u.path not in ("", "/"):
        raise ConfigError(field, f"{text!r} is not a ZMQ tcp endpoint",
                          "give tcp://HOST:PORT, the endpoint vLLM's KVEventsConfig publishes on")
    return u.hostname, port


def _offset(host: str, port: int, rank: int, field: str) -> str:
    from .subscriber import rank_endpoint
    if port + rank > 65535:
        raise ConfigError(field, f"rank {rank} would listen on port {port + rank}", "give a lower port or fewer ranks")
    host = f"[{host}]" if ":" in host else host
    return rank_endpoint(f"tcp://{host}:{port}", rank)


def parse_replica(text: str, index: int) -> ReplicaSpec:
    """A `--replica` value (see the module doc); `index` names it when no name= is given."""
    field = f"--replica {text!r}"
    head, *opt_parts = text.split(",")
    url, _, events = head.partition("=")
    u = urllib.parse.urlsplit(url)
    try:
        u.port
    except ValueError:
        u = u._replace(netloc="")
    if u.scheme not in ("http", "https") or not u.netloc or u.query or u.fragment or u.path not in ("", "/"):
        raise ConfigError(field, f"{url!r} is not a replica's base URL",
                          "give http://HOST:PORT=tcp://HOST:EVENT_PORT (the engine's OpenAI server and its KV events)")
    opts = {}
    for p in opt_parts:
        k, eq, v = p.partition("=")
        if (not eq and k != "bind") or (eq and k not in ("replay", "dp", "name")) or k in opts:
            raise ConfigError(field, f"{p!r} is not an option", "after the events endpoint give replay=tcp://HOST:PORT, "
                              "dp=N, name=NAME or bind, each once, separated by commas")
        opts[k] = v
    dp = opts.get("dp", "1")
    if not dp.isdigit() or not 1 <= int(dp) <= MAX_DP_RANKS:
        raise ConfigError(field, f"dp={dp!r} is not a rank count", f"give dp=N with 1 ≤ N ≤ {MAX_DP_RANKS}")
    for k in ("replay", "bind"):
        if not events and k in opts:
            raise ConfigError(field, f"{k} without an events endpoint", f"give URL=tcp://HOST:PORT,{k}…")
    ev = _endpoint(events, field) if events else None
    rp = _endpoint(opts["replay"], field) if "replay" in opts else None
    ranks = tuple(RankSpec(dp_rank=r, events_endpoint=_offset(*ev, r, field) if ev else None,
                           replay_endpoint=_offset(*rp, r, field) if rp else None) for r in range(int(dp)))
    name = opts.get("name") or f"r{index}"
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ConfigError(field, f"name={name!r}", "give a name of letters, digits, '-', '_' or '.'")
    return ReplicaSpec(name=name, url=urllib.parse.urlunsplit((u.scheme, u.netloc, "", "", "")), ranks=ranks,
                       bind="bind" in opts)


def parse_replicas(texts: list[str]) -> tuple[ReplicaSpec, ...]:
    if not texts:
        raise ConfigError("--replica", "no replica given", "give --replica http://HOST:PORT=tcp://HOST:EVENT_PORT once per replica")
    specs = tuple(parse_replica(t, i) for i, t in enumerate(texts))
    for what, key in (("name", lambda s: s.name), ("URL", lambda s: s.url)):
        seen = [key(s) for s in specs]
        dup = {x for x in seen if seen.count(x) > 1}
        if dup:
            raise ConfigError("--replica", f"the {what} {sorted(dup)[0]!r} is given twice", f"give each replica once, each with its own {what}")
    return specs


@dataclasses.dataclass(slots=True)
class ReplicaState:
    """What the router knows of one replica now (mutated on the event loop only)."""
    spec: ReplicaSpec
    up: bool = True
    down_reason: str = ""          # why it was taken out: refused, timeout, http_5xx, broken_stream, health
    down_since_s: float | None = None
    in_flight: int = 0             # requests the router has open to it
    running: int | None = None     # as its /metrics last said (None: it does not serve vLLM's gauges)
    waiting: int | None = None
    last_health_ok_s: float | None = None
    failures: int = 0
    recoveries: int = 0
    strikes: int = 0               # request failures since the last request it answered
    hold_until_s: float = 0.0      # a health check brings it back no earlier

    def take_out(self, reason: str, hold_s: float = 0.0) -> None:
        """Out until a health check passes, and no earlier than `hold_s` from now."""
        now = time.monotonic()
        if self.up:
            self.down_since_s = now
        self.up, self.down_reason = False, reason
        self.failures += 1
        self.hold_until_s = max(self.hold_until_s, now + hold_s)

    def request_failed(self, reason: str, base_hold_s: float, max_hold_s: float = 30.0) -> None:
        """A request failed on it: out, held back twice as long for each failure in a row, so a
        replica whose /health answers while its completions hang is not given request after request."""
        self.strikes += 1
        self.take_out(reason, min(max_hold_s, base_hold_s * 2 ** (self.strikes - 1)))

    def answered(self) -> None:
        self.strikes = 0

    def bring_back(self) -> None:
        if not self.up:
            self.recoveries += 1
        self.up, self.down_reason, self.down_since_s = True, "", None
        self.last_health_ok_s = time.monotonic()

    def load(self) -> int:
        """Requests on the replica: the larger of what the router has in flight and what the replica
        reported running + waiting (its report lags; the router's count misses other clients)."""
        reported = (self.running or 0) + (self.waiting or 0)
        return max(self.in_flight, reported)


def parse_vllm_load(text: str) -> tuple[int | None, int | None]:
    """(running, waiting) summed over engines from vLLM's /metrics text; None where absent."""
    running = waiting = None
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running") or line.startswith("vllm:num_requests_waiting"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            try:
                value = int(float(line.rsplit(" ", 1)[1]))
            except (ValueError, IndexError):
                continue
            if name == "vllm:num_requests_running":
                running = (running or 0) + value
            elif name == "vllm:num_requests_waiting":
                waiting = (waiting or 0) + value
    return running, waiting


class HealthChecker:
    """Every `interval_s`, each replica's /health (and /metrics for its load), all at once; a replica
    whose check fails is taken out, one that passes is brought back."""

    def __init__(self, states: list[ReplicaState], session, interval_s: float, timeout_s: float,
                 on_change=None) -> None:
        self.states, self.session = states, session
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.on_change = on_change or (lambda state, up: None)
        self.checks = 0

    async def run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval_s)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(s) for s in self.states))
        self.checks += 1

    async def check(self, state: ReplicaState) -> None:
        import aiohttp
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        was_up = state.up
        try:
            async with self.session.get(state.spec.url + "/health", timeout=timeout) as r:
                await r.read()
                ok = r.status == 200
            if ok:
                try:
                    async with self.session.get(state.spec.url + "/metrics", timeout=timeout) as r:
                        if r.status == 200:
                            state.running, state.waiting = parse_vllm_load(await r.text())
                except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError):
                    state.running = state.waiting = None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            ok = False
        if ok:
            state.last_health_ok_s = time.monotonic()
            if state.up or time.monotonic() >= state.hold_until_s:
                state.bring_back()
        elif state.up or state.down_reason != "health":
            state.take_out("health")
        if state.up != was_up:
            self.on_change(state, state.up)
