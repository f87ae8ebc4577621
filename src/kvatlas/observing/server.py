"""HTTP endpoints: /metrics (Prometheus text format), /state (JSON), /healthz.

Embeddable: `start(cache, port=0)` serves from a daemon thread of the caller's process and returns
a handle (`.port`, `.url`, `.close()`); an engine passes its own lock so a scrape never reads a
cache in the middle of a step. Standalone: `kvatlas serve`. The stdlib ThreadingHTTPServer is
enough here: a scrape is one O(1) snapshot plus text formatting, and it keeps the server free of
dependencies beyond prometheus_client. Binds 127.0.0.1 unless told otherwise: the state endpoint
exposes request ids.
"""

from __future__ import annotations

import errno
import json
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


def state_document(collector: KvatlasCollector, extra=None, requests=None) -> dict:
    """The /state JSON: per cache its rank labels, ledger snapshot, plan and per-request usage.

    `requests`: a callable returning per-request usage for the first cache (the driver knows the
    request progress); otherwise each running request's bytes come from `cache.request_usage`."""
    from ..planning.capacity import plan_to_dict
    snaps, hosts = collector.snapshots(), collector.host_snapshots()
    caches = []
    for i, (src, snap, host) in enumerate(zip(collector.sources, snaps, hosts)):
        if requests is not None and i == 0:
            usage = requests()
        else:
            with collector.lock:
                usage = {rid: {"pools": src.cache.request_usage(rid)} for rid in list(src.cache.allocator.slot_of)}
        entry = {"labels": dict(src.ranks), "ledger": snap.to_dict(), "plan": plan_to_dict(src.cache.plan),
                 "requests": {str(k): v for k, v in usage.items()},
                 # the tiers side by side: "ledger" is the device, "host_tier" pinned host memory
                 "host_tier": host.to_dict() if host is not None else None}
        if src.cache.prefix is not None:
            with collector.lock:
                entry["prefix_cache"] = src.cache.prefix.summary()
        caches.append(entry)
    doc = {"schema": "kvatlas.state", "schema_version": STATE_SCHEMA_VERSION, "time_unix_s": time.time(),
           "version": collector.version, "caches": caches}
    if extra is not None:
        doc["workload"] = extra()
    return doc


def _handler(server_state):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            try:
                if path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, generate_latest(server_state["registry"]))
                elif path == "/state":
                    doc = state_document(server_state["collector"], server_state["extra"], server_state["requests"])
                    self._send(200, "application/json", json.dumps(doc, default=_json_default).encode())
                elif path == "/healthz":
                    self._send(200, "text/plain; charset=utf-8", b"ok\n")
                else:
                    self._send(404, "text/plain; charset=utf-8", b"not found: try /metrics, /state or /healthz\n")
            except Exception as exc:   # a failed scrape must answer, not kill the serving thread
                self._send(500, "text/plain; charset=utf-8", f"{type(exc).__name__}: {exc}\n".encode())

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):   # scrapes every second would flood the terminal
            pass

    return Handler


def _json_default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


class ServerHandle:
    """A running endpoint server. `close()` stops it and closes the listening socket."""

    def __init__(self, httpd: ThreadingHTTPServer, thread: threading.Thread) -> None:
        self._httpd, self._thread = httpd, thread
        self.host, self.port = httpd.server_address[:2]
        self.closed = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

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


def start(cache_or_collector, host: str = "127.0.0.1", port: int = 0, *, lock=None, extra_state=None,
          request_state=None) -> ServerHandle:
    """Serve /metrics, /state and /healthz for a KVCache (or a KvatlasCollector over several).

    port=0 picks a free port (read it from the handle). `extra_state`: a callable whose dict is
    added to /state as "workload"; `request_state`: a callable giving per-request usage."""
    collector = (cache_or_collector if isinstance(cache_or_collector, KvatlasCollector)
                 else KvatlasCollector(cache_or_collector, lock=lock))
    state = {"collector": collector, "registry": registry_for(collector), "extra": extra_state,
             "requests": request_state}
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ServerError(f"port: {port!r} is not a TCP port; give 0..65535 (0 picks a free one)")
    try:
        httpd = ThreadingHTTPServer((host, port), _handler(state))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ServerError(f"port: {host}:{port} is already in use; stop what listens there, "
                              "or pick another --port (0 picks a free one)") from None
        raise ServerError(f"host: cannot listen on {host}:{port} ({exc.strerror or exc}); "
                          "give a local address such as 127.0.0.1") from None
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1},
                              name="kvatlas-http", daemon=True)
    thread.start()
    return ServerHandle(httpd, thread)
