"""HTTP endpoints: /metrics (Prometheus text format), /state (JSON), /healthz.

Embeddable: `start(cache, port=0)` serves from a daemon thread of the caller's process and returns
a handle (`.port`, `.url`, `.close()`); `start_pending(port=0)` opens the endpoints before there
is a cache (/healthz answers, /metrics and /state 503 until `handle.attach(cache)`); an engine passes its own lock so a scrape never reads a
cache in the middle of a step. Standalone: `kvatlas serve`. The stdlib ThreadingHTTPServer is
enough here: a scrape is one O(1) snapshot plus text formatting, and it keeps the server free of
dependencies beyond prometheus_client. Binds 127.0.0.1 unless told otherwise: the state endpoint
exposes request ids.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..errors import KvatlasError
from .metrics import KvatlasCollector, registry_for

STATE_SCHEMA_VERSION = 1


class ServerError(KvatlasError):
    """The endpoint server cannot start (address in use, bad host)."""


class FairLock:
    """A lock that serves waiters in arrival order. A driver that releases its lock at the end of
    a forward pass and takes it again for the next would, with threading.Lock, win almost every
    time (it still runs; the waiter has to be woken), so a scrape could wait seconds for one
    snapshot. Here a thread that re-acquires queues behind those already waiting: a scrape waits
    at most for the pass in progress. Uncontended it costs about a microsecond more."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next = self._serving = 0

    def acquire(self) -> bool:
        with self._cond:
            ticket = self._next
            self._next += 1
            while ticket != self._serving:
                self._cond.wait()
        return True

    def release(self) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def check_host(host) -> str | None:
    """Refuse an address that would expose the endpoints beyond this machine by accident.

    Loopback addresses are fine. "" (which binds every interface) and any other address are
    refused, except exactly "0.0.0.0", the explicit way to say "every interface": that returns
    a warning to show, because the endpoints have no authentication and /state lists request ids."""
    if not isinstance(host, str) or not host.strip():
        raise ServerError(f"host: {host!r} would listen on every interface; give 127.0.0.1 (loopback), "
                          "or say 0.0.0.0 explicitly to accept connections from other machines")
    if host == "0.0.0.0":
        return ("listening on every interface (0.0.0.0): /metrics and /state have no authentication "
                "and /state lists request ids; keep the port behind a firewall")
    if host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    raise ServerError(f"host: {host!r} is not a loopback address, and the endpoints have no authentication; "
                      "give 127.0.0.1, or 0.0.0.0 to listen on every interface on purpose")


def state_document(collector: KvatlasCollector, extra=None, requests=None, plans=None) -> dict:
    """The /state JSON: per cache its rank labels, ledger snapshot, plan and per-request usage.

    One snapshot: the ledgers, the per-request counters and the workload's view (`extra`, and
    `requests`, per-request progress for the first cache) are all read under ONE acquisition of
    the lock the driver mutates under, so the running-request count, the request list and the
    bytes agree. Under the lock only copies are taken (a ledger snapshot, a few small arrays, the
    progress dict); the bytes and the JSON are made after it is released, so a scrape holds up a
    forward pass no longer than a snapshot. `extra` and `requests` must not take that lock."""
    from ..planning.capacity import plan_to_dict
    with collector.lock:
        snaps = [s.cache.ledger.snapshot() for s in collector.sources]
        counters = [s.cache.usage_counters() for s in collector.sources]
        prefixes = [s.cache.prefix.summary() if s.cache.prefix is not None else None for s in collector.sources]
        hosts = [s.cache.host.snapshot() if s.cache.host is not None else None for s in collector.sources]
        shared = [s.cache.host.shared_snapshot() if s.cache.host is not None else None for s in collector.sources]
        progress = requests() if requests is not None else None
        workload = extra() if extra is not None else None
    caches = []
    for i, (src, snap, c) in enumerate(zip(collector.sources, snaps, counters)):
        usage = src.cache.usage_of(c)
        if i == 0 and progress is not None:
            usage = {rid: {**progress.get(rid, {}), "pools": pools} for rid, pools in usage.items()}
        else:
            usage = {rid: {"pools": pools} for rid, pools in usage.items()}
        plan = plans[i] if plans is not None else plan_to_dict(src.cache.plan)
        entry = {"labels": dict(src.ranks), "ledger": snap.to_dict(), "plan": plan,
                 "requests": {str(k): v for k, v in usage.items()},
                 # the tiers side by side: "ledger" is the device, "host_tier" pinned host memory
                 "host_tier": hosts[i].to_dict() if hosts[i] is not None else None,
                 "shared_tier": shared[i].to_dict() if shared[i] is not None else None}
        if prefixes[i] is not None:
            entry["prefix_cache"] = prefixes[i]
        caches.append(entry)
    doc = {"schema": "kvatlas.state", "schema_version": STATE_SCHEMA_VERSION, "time_unix_s": time.time(),
           "version": collector.version, "caches": caches}
    if workload is not None:
        doc["workload"] = workload
    return doc


_QUIET = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)


class ScrapeGate:
    """Scrapes share the process (and its interpreter lock) with the engine they observe, so they
    are rationed: one is built at a time; a request that arrives while a build is running, or
    waits for one, gets the next build of its path made after it arrived (never an older one);
    and after each build the gate stays shut for `yield_factor` times the CPU time the build took
    (at most `max_pause_s`), so scraping takes at most 1 / (1 + yield_factor) of the process's
    time however many scrapers ask and however fast. With Prometheus' usual one scrape per several seconds the
    pause is never felt; eight scrapers in a tight loop wait their turn instead of taking the
    forward passes' time (bench/serve_scrapers.py)."""

    def __init__(self, yield_factor: float = 19.0, max_pause_s: float = 0.25) -> None:
        self.lock = threading.Lock()
        self.yield_factor, self.max_pause_s = yield_factor, max_pause_s
        self._latest: dict[str, tuple[float, bytes]] = {}   # path → (build start, body)
        self._debt_lock = threading.Lock()
        self._debt_s = 0.0

    def get(self, path: str, build):
        """(body, pause_s): the caller answers, then calls `done(pause_s)` (the gate is held)."""
        arrived = time.monotonic()
        self.lock.acquire()
        hit = self._latest.get(path)
        if hit is not None and hit[0] >= arrived:
            return hit[1], 0.0
        start, cpu0 = time.monotonic(), time.thread_time()
        try:
            body = build()
        except BaseException:
            self.lock.release()
            raise
        cost = time.thread_time() - cpu0   # the interpreter time taken, not time spent waiting for it
        self._latest[path] = (start, body)
        with self._debt_lock:
            cost, self._debt_s = cost + self._debt_s, 0.0
        return body, min(cost * self.yield_factor, self.max_pause_s)

    def charge(self, cpu_s: float) -> None:
        """CPU time spent outside builds (reading requests, writing answers): it is paid for by
        the pause after the next build, so many cheap requests cannot take the time either."""
        with self._debt_lock:
            self._debt_s += cpu_s

    def done(self, pause_s: float) -> None:
        if pause_s > 0:
            time.sleep(pause_s)
        self.lock.release()


def _handler(server_state):
    gate: ScrapeGate = server_state["gate"]

    def metrics() -> bytes:
        return generate_latest(server_state["registry"])

    def state() -> bytes:
        doc = state_document(server_state["collector"], server_state["extra"], server_state["requests"],
                             server_state["plans"])
        return json.dumps(doc, default=_json_default).encode()

    builders = {"/metrics": (CONTENT_TYPE_LATEST, metrics), "/state": ("application/json", state)}

    class Handler(BaseHTTPRequestHandler):
        def handle(self):
            cpu0 = time.thread_time()
            try:
                super().handle()
            finally:
                gate.charge(time.thread_time() - cpu0)

        def do_GET(self):  # noqa: N802 (http.server's name)
            self._answer(head=False)

        def do_HEAD(self):  # noqa: N802
            self._answer(head=True)

        def _answer(self, head: bool) -> None:
            path = self.path.split("?", 1)[0]
            starting = server_state["collector"] is None
            try:
                if path in builders and starting:   # not ready: what it is doing, and "try again"
                    self._send(503, "text/plain; charset=utf-8",
                               f"starting: {server_state['phase']}\n".encode(), head, retry=True)
                elif path in builders:
                    self._scrape(path, head)
                elif path == "/healthz":            # alive, whatever the phase
                    self._send(200, "text/plain; charset=utf-8",
                               f"starting: {server_state['phase']}\n".encode() if starting else b"ok\n", head)
                else:
                    self._send(404, "text/plain; charset=utf-8", b"not found: try /metrics, /state or /healthz\n", head)
            except _QUIET:   # the client left early: nothing to answer, nothing to report
                self.close_connection = True

        def _scrape(self, path: str, head: bool) -> None:
            ctype, build = builders[path]
            try:
                body, pause = gate.get(path, build)
            except Exception as exc:   # a failed scrape must answer, not kill the serving thread
                self._send(500, "text/plain; charset=utf-8", f"{type(exc).__name__}: {exc}\n".encode(), head)
                return
            try:
                self._send(200, ctype, body, head)
            finally:
                gate.done(pause)

        def _send(self, code: int, ctype: str, body: bytes, head: bool, retry: bool = False) -> None:
            self.send_response(code)
            if retry:
                self.send_header("Retry-After", "1")
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def log_message(self, *args):   # scrapes every second would flood the terminal
            pass

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    address_family = socket.AF_INET
    request_queue_size = 128   # socketserver's 5 drops the SYNs of a sixth concurrent scraper: 1-s retries

    def handle_error(self, request, client_address):
        """A client that disconnects mid-request is not an error worth a traceback on stderr."""
        if isinstance(sys.exc_info()[1], OSError):   # resets, broken pipes, timeouts
            return
        super().handle_error(request, client_address)


class _Server6(_Server):
    address_family = socket.AF_INET6


def _server_class(host: str):
    """IPv6 addresses (::1) need an IPv6 socket; names and IPv4 addresses an IPv4 one."""
    return _Server6 if ":" in host else _Server


def _json_default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


class ServerHandle:
    """A running endpoint server. `close()` stops it and closes the listening socket."""

    def __init__(self, httpd: ThreadingHTTPServer, thread: threading.Thread, state: dict | None = None) -> None:
        """`state`: the endpoints' own (start_pending); None for a server that serves from the start."""
        self._httpd, self._thread = httpd, thread
        self._state = state if state is not None else {"collector": True, "phase": "serving"}
        self.host, self.port = httpd.server_address[:2]
        self.closed = False

    @property
    def attached(self) -> bool:
        return self._state["collector"] is not None

    @property
    def phase(self) -> str:
        return self._state["phase"]

    def attach(self, cache_or_collector, *, lock=None, extra_state=None, request_state=None) -> None:
        """Serve this cache (or collector) from now on: /metrics and /state answer 200."""
        collector = _collector(cache_or_collector, lock)
        from ..planning.capacity import plan_to_dict
        self._state.update(registry=registry_for(collector), extra=extra_state, requests=request_state,
                           plans=[plan_to_dict(src.cache.plan) for src in collector.sources])
        self._state["collector"] = collector   # last: a scrape sees the collector only with the rest

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _collector(cache_or_collector, lock=None) -> KvatlasCollector:
    if cache_or_collector is None or (isinstance(cache_or_collector, KvatlasCollector)
                                      and not cache_or_collector.sources):
        raise ServerError("cache: nothing to serve; give a KVCache (kvatlas.allocate) or a KvatlasCollector "
                          "with at least one cache")
    return (cache_or_collector if isinstance(cache_or_collector, KvatlasCollector)
            else KvatlasCollector(cache_or_collector, lock=lock))


def start(cache_or_collector, host: str = "127.0.0.1", port: int = 0, *, lock=None, extra_state=None,
          request_state=None, gate: ScrapeGate | None = None) -> ServerHandle:
    """Serve /metrics, /state and /healthz for a KVCache (or a KvatlasCollector over several).

    port=0 picks a free port (read it from the handle). `extra_state`: a callable whose dict is
    added to /state as "workload"; `request_state`: a callable giving per-request progress (both
    are called under the lock, beside the ledger snapshot: they must be cheap and not lock).
    `gate`: how scrapes are rationed (ScrapeGate; ScrapeGate(yield_factor=0) never pauses)."""
    collector = _collector(cache_or_collector, lock)
    handle = start_pending(host, port, gate=gate)
    handle.attach(collector, extra_state=extra_state, request_state=request_state)
    return handle


def start_pending(host: str = "127.0.0.1", port: int = 0, *, gate: ScrapeGate | None = None,
                  phase: str = "starting") -> ServerHandle:
    """The endpoints before there is a cache to serve (`kvatlas serve` opens them first, then
    reads its workload and opens its stores): /healthz answers 200 ("starting: PHASE"), /metrics
    and /state 503 with Retry-After until `handle.attach(cache)`."""
    check_host(host)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ServerError(f"port: {port!r} is not a TCP port; give 0..65535 (0 picks a free one)")
    state = {"collector": None, "registry": None, "extra": None, "requests": None, "plans": None,
             "gate": ScrapeGate() if gate is None else gate, "phase": phase}
    try:
        httpd = _server_class(host)((host, port), _handler(state))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ServerError(f"port: {host}:{port} is already in use; stop what listens there, "
                              "or use another port (port=0 picks a free one)") from None
        raise ServerError(f"host: cannot listen on {host}:{port} ({exc.strerror or exc}); "
                          "give a local address such as 127.0.0.1") from None
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1},
                              name="kvatlas-http", daemon=True)
    thread.start()
    return ServerHandle(httpd, thread, state)
