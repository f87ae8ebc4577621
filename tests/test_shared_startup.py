"""Start-up is bounded (issue 33): opening a shared store waits at most the start-up bound, on a
thread of its own; a store not open by then serves misses (`tier_unavailable`) while it is tried
again in the background, and serves once it opens; a store that answers and refuses is refused.
`kvatlas serve` opens its endpoints and its signal handlers first: against a Mooncake master or
a Redis that is down, blackholed (accepts, never answers) or never accepts, and with a
--workload pipe that never writes, /healthz answers within seconds and SIGTERM stops it with
status 0 and its summary. (A slow master, behind a proxy that delays every chunk, and a
password-protected redis-server are in tests/shared_live.py, with the real servers.)

The listeners here are sockets of this process on 127.0.0.1, closed by the test; Mooncake's
client binds loopback only (MC_TCP_BIND_ADDRESS, set by store_servers)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import store_servers as ss
from kvatlas.errors import ConfigError
from kvatlas.tiers.shared import Entry, OpeningStore, SharedTier, StoreUnavailable, open_store
from kvatlas.tiers.shared import opening as store_mod
from kvatlas.tiers.shared.memory_store import MemoryStore
from kvatlas.tiers.shared.values import Layout

LAYOUT = Layout(namespace="t", layout_hash=3, payload_bytes={"page": 256, "checkpoint": 64})


class Gate(MemoryStore):
    """A store whose `open` waits on `release` (a store that does not answer), fails while
    `refuse` is set (refused: may pass), or raises `answer` (it answered and refused)."""

    name = "gate"

    def __init__(self, wait_s: float = 0.0, refuse: bool = False, answer=None) -> None:
        super().__init__()
        self.release, self.wait_s, self.refuse, self.answer = threading.Event(), wait_s, refuse, answer
        self.ready, self.opens, self.registered = False, 0, []
        if not wait_s:
            self.release.set()

    def open(self, bound_s: float) -> None:
        self.opens += 1
        if not self.release.wait(min(self.wait_s or bound_s, bound_s)):
            raise StoreUnavailable(f"{self.describe()}: no answer within {bound_s:g} s")
        if self.answer is not None:
            raise self.answer
        if self.refuse:
            raise StoreUnavailable(f"{self.describe()}: connection refused")
        self.ready = True

    def register(self, array) -> None:
        self.registered.append(array)


class _Backend:
    """What open_store asks of a scheme's backend class: `check(url, field)`, then one made."""

    def __init__(self, backend) -> None:
        self.backend = backend

    @staticmethod
    def check(u, field) -> None:
        pass

    def __call__(self, u, field):
        return self.backend


def _patched(monkeypatch, backend):
    monkeypatch.setattr(store_mod, "_backend", lambda scheme: _Backend(backend))
    return "redis://127.0.0.1:6379"


def test_open_store_waits_at_most_the_bound_for_a_store_that_does_not_answer(monkeypatch):
    gate = Gate(wait_s=60.0)
    url = _patched(monkeypatch, gate)
    t = time.monotonic()
    s = open_store(url, startup_s=0.3)
    took = time.monotonic() - t
    assert isinstance(s, OpeningStore) and not s.ready and took < 3.0, took
    assert "not open" in s.describe() and "trying again" in s.describe()
    with pytest.raises(StoreUnavailable):
        s.get_many(["k"], [[np.zeros(4, np.uint8)]])
    gate.release.set()          # it answers: the next attempt (after the back-off) opens it
    assert s.wait(10.0) and s.ready and s.describe() == gate.describe()
    s.close()


def test_a_store_that_answers_and_refuses_is_refused_at_once(monkeypatch):
    url = _patched(monkeypatch, Gate(answer=ConfigError("--shared-tier", "redis needs a password (NOAUTH)", "fix")))
    t = time.monotonic()
    with pytest.raises(ConfigError, match="NOAUTH") as e:
        open_store(url, "--shared-tier", startup_s=30)
    assert e.value.field == "--shared-tier" and time.monotonic() - t < 5


def test_an_open_store_is_the_backend_itself(monkeypatch):
    gate = Gate()
    assert open_store(_patched(monkeypatch, gate), startup_s=5) is gate and gate.ready


def test_a_tier_over_a_store_not_open_yet_misses_then_serves(monkeypatch):
    """Until the store opens: reads miss (`tier_unavailable`), puts are skipped, no error and no
    breaker; the memory registered meanwhile reaches the store before it serves; then hits."""
    gate = Gate(refuse=True)
    s = open_store(_patched(monkeypatch, gate), startup_s=0.2)
    assert isinstance(s, OpeningStore) and "connection refused" in s.describe()
    tier = SharedTier(s, LAYOUT, deadline_s=1.0)
    src, dst = np.arange(256, dtype=np.uint8), np.zeros(256, np.uint8)
    assert tier.put([Entry("page", 7, 0, (src,))]) is False
    assert tier.get([Entry("page", 7, 0, (dst,))]).reasons == ["tier_unavailable"]
    assert tier.exists([Entry("page", 7, 0)]) is None
    snap = tier.snapshot()
    assert snap.misses["page"]["tier_unavailable"] == 2 and snap.puts["page"]["skipped"] == 1
    assert sum(snap.errors.values()) == 0 and tier.breaker.times_opened == 0 and "not open" in snap.store
    assert snap.breaker_open and snap.breaker_state == "store_not_open"   # bypassed: the gauge and its alert see it
    assert gate.registered == []          # (the tier's header slots wait for the store)
    gate.refuse = False
    assert s.wait(10.0)
    assert len(gate.registered) == 1 and gate.registered[0] is tier._headers
    assert tier.put([Entry("page", 7, 0, (src,))]) is True
    tier.flush(5.0)
    assert tier.get([Entry("page", 7, 0, (dst,))]).reasons == [None] and np.array_equal(dst, src)
    snap = tier.snapshot()
    assert snap.store == "memory (1 values, 320 B)" and not snap.breaker_open and snap.breaker_state == "closed"
    tier.close()


def test_retries_back_off_and_stop_when_closed(monkeypatch):
    gate = Gate(refuse=True)
    s = open_store(_patched(monkeypatch, gate), startup_s=0.2)
    time.sleep(1.2)                     # attempts at 0, 0.5 and 1.5 s: never more than one at a time
    assert 2 <= gate.opens <= 3, gate.opens
    s.close()
    n = gate.opens
    time.sleep(1.5)
    assert gate.opens <= n + 1 and not s.ready


def test_startup_bound_is_checked():
    for bad in (0, -1, float("nan"), float("inf"), 601, "5", True):
        with pytest.raises(ConfigError, match="startup_s"):
            open_store("memory://x", startup_s=bad)


# ------------------------------------------------------------------ kvatlas serve against stores that do not answer
class Listener:
    """A port on 127.0.0.1: "blackholed" accepts and never answers; "unaccepted" never accepts
    (its one-slot queue is filled first, so later connects wait); "down": nothing listens."""

    def __init__(self, kind: str) -> None:
        self.sock = socket.socket()
        self.sock.bind((ss.LOOPBACK, 0))
        self.port = self.sock.getsockname()[1]
        self.held: list = []
        if kind == "down":
            self.sock.close()
            return
        self.sock.listen(0 if kind == "unaccepted" else 16)
        if kind == "blackholed":
            threading.Thread(target=self._accept, daemon=True).start()
        else:
            for _ in range(2):   # fill the accept queue: the next SYNs are dropped
                c = socket.socket()
                c.setblocking(False)
                c.connect_ex((ss.LOOPBACK, self.port))
                self.held.append(c)

    def _accept(self) -> None:
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        for c in [self.sock, *self.held]:
            c.close()


LIVE = False   # set by tests/shared_live.py, which runs the tests here that need a store's client


def client(name: str):
    """The store client module `name`, or a skip saying why. In CI's main suite the clients are
    being installed beside it, so these tests skip there and run in tests/shared_live.py (which
    sets LIVE), where a missing client fails under KVATLAS_REQUIRE_STORES."""
    import importlib
    if os.environ.get("KVATLAS_SHARED_LIVE_RUN") and not LIVE:
        pytest.skip("CI runs this in tests/shared_live.py, once the store clients are installed")
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        (ss.missing if LIVE else pytest.skip)(f"{name} cannot be imported ({exc})")


def _url(scheme: str, port: int) -> str:
    if scheme == "mooncake":
        client("mooncake.store")
        return f"mooncake://{ss.LOOPBACK}:{port}?metadata=http://{ss.LOOPBACK}:{port}/metadata&buffer=16MiB"
    client("redis")
    return f"redis://{ss.LOOPBACK}:{port}?timeout=0.5"


SERVE = ["serve", "tiny-v4", "--memory", "64MiB", "--max-running-requests", "4", "--prefix-checkpoints", "4",
         "--write-layers", "0", "--progress-s", "3600", "--rate", "8", "--duration", "30", "--prompt-len", "600",
         "--output-len", "8", "--system-prompts", "1", "--system-prompt-len", "520"]


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Serve:
    def __init__(self, *args: str) -> None:
        self.port = ss.free_port()
        self.url = f"http://{ss.LOOPBACK}:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvatlas", *SERVE, "--port", str(self.port), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.started = time.monotonic()

    def healthz(self, within_s: float = 15.0) -> tuple[float, str]:
        """Seconds until /healthz answered 200, and its body."""
        end = self.started + within_s
        while time.monotonic() < end:
            assert self.proc.poll() is None, self.proc.communicate()[1][-2000:]
            try:
                code, body = _get(self.url + "/healthz")
                if code == 200:
                    return time.monotonic() - self.started, body
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"/healthz did not answer within {within_s} s")

    def stop(self) -> tuple[int, str, str, float]:
        t = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            out, err = self.proc.communicate(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.communicate()
        return self.proc.returncode, out, err, time.monotonic() - t


@pytest.mark.parametrize("scheme,kind", [("mooncake", "down"), ("mooncake", "blackholed"), ("mooncake", "unaccepted"),
                                         ("redis", "down"), ("redis", "blackholed")])
def test_serve_answers_healthz_and_stops_on_sigterm_while_the_store_opens(scheme, kind):
    """A start-up bound far beyond the test: the store is still opening when SIGTERM comes."""
    sock = Listener(kind)
    port = sock.port
    try:
        s = Serve("--host-memory", "8MiB", "--shared-tier", _url(scheme, port), "--shared-startup-s", "120")
        took, body = s.healthz()
        if scheme == "mooncake" or kind != "down":   # (a refused Redis is known at once: it goes on serving)
            assert body.startswith("starting: opening the shared store"), body
            assert _get(s.url + "/state")[0] == 503
        time.sleep(0.5)
        rc, out, err, stop_s = s.stop()
    finally:
        sock.close()
    assert rc == 0, err[-2000:]
    assert "stopped by SIGTERM" in out and "summary" in out and "Traceback" not in err
    assert stop_s < 15, stop_s
    if scheme == "mooncake":   # the probe process went with it
        assert not [p for p in os.listdir("/proc") if p.isdigit() and _probe_of(p, port)]


def _probe_of(pid: str, port: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return b"MooncakeDistributedStore" in cmd and f":{port}".encode() in cmd


def test_a_probe_whose_parent_already_left_exits_before_it_connects():
    """The death signal is armed in the probe, after it started: a parent gone by then is noticed
    by its pid, and the probe ends without calling Mooncake (exit 3, no `rc` printed)."""
    from kvatlas.tiers.shared.mooncake_store import _PROBE
    args = json.dumps({"local": "127.0.0.1", "metadata": "P2PHANDSHAKE", "protocol": "tcp", "device": "",
                       "master": "127.0.0.1:9"})
    gone = subprocess.run([sys.executable, "-c", _PROBE, args, "1"],   # not the probe's parent: it had left
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == 3 and "rc" not in gone.stdout, (gone.returncode, gone.stdout, gone.stderr[-500:])


def test_serve_leaving_at_once_kills_the_probes_it_started(monkeypatch):
    """`serve` stopped during start-up leaves through os._exit, which skips atexit: it kills the
    store probes itself first."""
    from kvatlas.cli import serve
    from kvatlas.tiers.shared import store
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    store._PROBES.add(proc)
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    alive = threading.Thread(target=time.sleep, args=(5,), daemon=True)
    alive.start()
    stop = serve._Stop()
    stop.builder = alive
    try:
        serve._leave(0, stop)
        assert exits == [0] and proc.poll() is not None
    finally:
        store._PROBES.discard(proc)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("scheme", ["mooncake", "redis"])
def test_serve_runs_with_misses_while_the_store_is_not_open(scheme):
    """Past the start-up bound it serves: /state is 200, the shared tier says what is wrong and
    counts `tier_unavailable` misses (no error); SIGTERM stops it with status 0 and the summary."""
    sock = Listener("blackholed")
    port = sock.port
    try:
        s = Serve("--host-memory", "8MiB", "--shared-tier", _url(scheme, port), "--shared-startup-s", "0.5")
        s.healthz()
        end, doc = time.monotonic() + 30, None
        while time.monotonic() < end:
            code, body = _get(s.url + "/state")
            if code == 200:
                doc = json.loads(body)["caches"][0]["shared_tier"]
                if doc["misses"]["page"]["tier_unavailable"] + doc["misses"]["checkpoint"]["tier_unavailable"] > 0:
                    break
            time.sleep(0.2)
        rc, out, err, _ = s.stop()
    finally:
        sock.close()
    assert doc is not None and "not open" in doc["store"] and "trying again" in doc["store"], doc
    assert doc["misses"]["page"]["tier_unavailable"] + doc["misses"]["checkpoint"]["tier_unavailable"] > 0
    assert sum(doc["errors"].values()) == 0 and doc["hits"]["page"] == 0
    assert rc == 0 and "stopped by SIGTERM; endpoint closed" in out, err[-2000:]
    line = next(x for x in out.splitlines() if x.startswith("shared tier"))
    assert "not open" in line and "tier_unavailable" in line
    warn = [x for x in err.splitlines() if "warning: --shared-tier" in x]
    assert len(warn) == 1 and "tier_unavailable" in warn[0]


def test_serve_answers_healthz_and_stops_on_sigterm_while_a_workload_pipe_never_writes(tmp_path):
    fifo = tmp_path / "trace.jsonl"
    os.mkfifo(fifo)
    for opened in (False, True):    # no writer at all (its open waits), a writer that never writes (its read waits)
        hold = os.open(fifo, os.O_RDWR | os.O_NONBLOCK) if opened else None
        try:
            s = Serve("--workload", str(fifo))
            _, body = s.healthz()
            assert body.startswith("starting: reading the workload"), body
            assert _get(s.url + "/metrics")[0] == 503
            rc, out, err, stop_s = s.stop()
        finally:
            if hold is not None:
                os.close(hold)
        assert rc == 0 and "stopped by SIGTERM while starting" in out and "summary" in out, err[-2000:]
        assert "Traceback" not in err and stop_s < 15


def test_simulate_against_a_dead_port_warns_once_and_runs_with_misses(tmp_path, capsys):
    """Refused (nothing listens): one warning line naming the flag and what is wrong, then the
    run, its shared tier line saying the store is not open and counting tier_unavailable."""
    client("redis")
    from kvatlas.cli import main
    port = ss.free_port()
    rc = main(["simulate", "tiny-v4", "--memory", "64MiB", "--max-running-requests", "4", "--rate", "8", "--duration",
               "0.5", "--prompt-len", "600", "--output-len", "4", "--system-prompts", "1", "--system-prompt-len", "520",
               "--prefix-checkpoints", "4", "--host-memory", "8MiB", "--write-layers", "0", "--no-plot",
               "--shared-tier", f"redis://{ss.LOOPBACK}:{port}", "--shared-startup-s", "0.5", "--out", str(tmp_path / "s")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert err.count("\n") == 1 and err.startswith("kvatlas simulate: warning: --shared-tier: redis ")
    assert "Connection refused" in err and "tier_unavailable" in err
    line = next(x for x in out.splitlines() if x.startswith("shared tier"))
    assert "not open" in line and "tier_unavailable" in line and "errors 0" in line, line


@pytest.mark.parametrize("error", [ValueError("I/O operation on closed file"), RuntimeError("x"),
                                   "ConnectionError", "ResponseError", "DataError"])
def test_every_error_of_the_redis_client_after_start_up_is_a_named_miss(error):
    """Once open, whatever the client raises (its own errors, or any other class) is a miss with
    reason `tier_unavailable` and an error counted, never an exception to the caller."""
    redis = client("redis")
    from kvatlas.tiers.shared.redis_store import RedisStore
    from kvatlas.tiers.shared.opening import check_url
    store = RedisStore(check_url(f"redis://{ss.LOOPBACK}:{ss.free_port()}?timeout=0.5"))   # (no connection made)
    exc = getattr(redis.exceptions, error)("from the client") if isinstance(error, str) else error

    def fail(*a, **k):
        raise exc
    store.r.mget = store.r.pipeline = fail
    store.ready = True     # as after a PING that answered
    tier = SharedTier(store, LAYOUT, deadline_s=5.0)
    dst = np.zeros(256, np.uint8)
    got = tier.get([Entry("page", 7, 0, (dst,))])
    assert got.reasons == ["tier_unavailable"] and not dst.any()
    assert tier.snapshot().errors["get"] == 1
    tier.close()
