"""Live shared-store tests: real servers (Mooncake's metadata server, master and memory daemon;
redis-server) on loopback, started and stopped here by PID. Run by tests/test_shared_live.py
inside a network namespace that has only `lo` (so nothing here can reach or be reached from any
other address), or directly: python -m pytest -q tests/shared_live.py.

One process stores a prefix and another restores it and reads exactly what its cold twin
reads; a partial prefix; two processes writing the same key; stale, foreign, corrupt (two
compensating bit flips, two swapped words and two swapped rows too) and truncated values read as
misses with their reason; eviction under a small store; a full Redis; the memory daemon, the
master and redis-server killed mid-run; a password-protected Redis, Redis over TLS and a Mooncake
master behind a slow proxy; and the start-up tests of test_shared_startup.py that need a store's
client (a master or Redis down, blackholed or never accepting)."""

from __future__ import annotations

import json
import re
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import store_servers as ss  # noqa: E402
from shared_session import SharedSession, Writer, admit_only, prompts, write_through  # noqa: E402

from kvatlas.tiers.shared import Breaker, open_store  # noqa: E402
from kvatlas.tiers.shared.values import HEADER_BYTES  # noqa: E402

# The tests of start-up and the URL that need a store's client (not its server) run here in CI,
# where the clients are installed (the main suite skips them there: they are being installed
# beside it); a missing client fails them here.
import test_shared_startup  # noqa: E402
test_shared_startup.LIVE = True
from test_bad_input_cli import no_allocation, test_shared_tier_on_a_port_that_is_not_redis  # noqa: E402,F401
from test_shared_startup import (  # noqa: E402,F401
    test_every_error_of_the_redis_client_after_start_up_is_a_named_miss,
    test_serve_answers_healthz_and_stops_on_sigterm_while_the_store_opens, test_serve_runs_with_misses_while_the_store_is_not_open,
    test_simulate_against_a_dead_port_warns_once_and_runs_with_misses)

BACKENDS = ("redis", "mooncake")
if ss.only_loopback_here():
    ss.loopback_up()


def start(kind, tmp, **kw):
    return (ss.Redis(tmp, **kw) if kind == "redis" else ss.Mooncake(tmp, **kw)).start()


SEEDS = {"restore": 101, "partial": 102, "stale": 110, "foreign": 111, "corrupt": 112, "size_mismatch": 113,
         "compensating": 114, "swapped_words": 115, "swapped_rows": 116}


@pytest.fixture(scope="module", params=BACKENDS)
def servers(request, tmp_path_factory):
    srv = start(request.param, tmp_path_factory.mktemp(request.param))
    srv.kind = request.param
    # one other process writes the prefixes the tests below read (one start-up, not one per test)
    srv.written = writer(srv.url, *SEEDS.values(), prompts_each=2)   # each: a turn and its follow-up
    yield srv
    srv.stop()


def writer(url, *seeds, prompts_each=1, writer_id=1, wait=True, prefetch=True):
    """Another process that runs the prompts of `seeds` and writes them through to the store."""
    args = [sys.executable, os.path.join(HERE, "shared_session.py"), url, ",".join(map(str, seeds)),
            "--prompts", str(prompts_each), "--writer", str(writer_id)] + ([] if prefetch else ["--no-prefetch"])
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return p
    return finish(p)


def finish(p):
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def reader(url, **kw):
    return SharedSession(url, **kw)


def key(s, kind, seq, page):
    from kvatlas.prefix import page_keys
    return s.link.shared.layout.key(kind, int(page_keys(seq, 256)[page]))


def test_every_server_listens_on_loopback_only(servers):
    ss.check_loopback_only(servers.servers)
    if servers.kind == "mooncake":   # the daemon binds every interface: only a namespace keeps it in
        assert ss.only_loopback_here(), "Mooncake's tests run in a network namespace with only lo"


def test_another_process_restores_a_prefix_and_reads_what_a_cold_run_reads(servers):
    got = servers.written
    assert got["cached"] == [0, 512] * len(SEEDS)   # (the writer's follow-ups hit its own device)
    assert got["puts"]["page"]["stored"] == 3 * len(SEEDS) and got["puts"]["checkpoint"]["stored"] == 2 * len(SEEDS)
    s = reader(servers.url)
    first, follow = prompts(SEEDS["restore"], 2)
    assert s.run(first) == 512            # its 2 full pages and resume point, from the other process
    assert s.run(follow) == 768           # its follow-up: 2 pages from this device, 1 + resume point from the store
    snap = s.close()
    assert snap.hits["page"] == 3 and snap.hits["checkpoint"] == 2 and snap.hit_tokens == 512 + 256
    assert sum(snap.errors.values()) == 0 and sum(sum(m.values()) for m in snap.misses.values()) == 0


def test_a_partial_prefix_resumes_at_the_deepest_point_before_the_gap(servers):
    # written by another process: a turn (2 pages, a resume point at 512), then its follow-up
    s = reader(servers.url)
    follow = prompts(SEEDS["partial"], 2)[1]
    store = s.link.shared.store
    assert store.raw_get(key(s, "checkpoint", follow, 2)) is not None   # the follow-up's own, at 768
    store.raw_remove(key(s, "page", follow, 2))   # the follow-up's third page is gone
    assert s.run(follow) == 512                   # resumes before the gap (reads checked against the cold twin)
    s.close()


def test_two_processes_writing_the_same_prefix_leave_one_value_each(servers):
    # both compute the prefix (neither reads the store first) and write it through
    a, b = (writer(servers.url, 103, writer_id=w, wait=False, prefetch=False) for w in (1, 2))
    ra, rb = finish(a), finish(b)
    stored = ra["puts"]["page"]["stored"] + rb["puts"]["page"]["stored"]
    exists = ra["puts"]["page"]["exists"] + rb["puts"]["page"]["exists"]
    assert stored + exists == 4 and stored >= 2
    if servers.kind == "redis":   # SET NX: exactly one writer stored each page
        assert stored == 2
    s = reader(servers.url)
    seq = prompts(103)[0]
    writers = {struct.unpack_from("<Q", s.link.shared.store.raw_get(key(s, "page", seq, i)), 48)[0] for i in range(2)}
    assert writers <= {1, 2}
    assert admit_only(s, seq) == 512
    s.close()


def _damage(blob: bytes, how: str) -> bytes:
    b = bytearray(blob)
    if how == "stale":
        struct.pack_into("<H", b, 4, 99)
    elif how == "foreign":
        struct.pack_into("<Q", b, 8, struct.unpack_from("<Q", b, 8)[0] ^ 1)
    elif how == "corrupt":
        b[HEADER_BYTES + 1000] ^= 0x40
    elif how == "compensating":   # bit 3 flipped in two 8-byte words, one 0->1, one 1->0 (format 1 missed it)
        at = [next(HEADER_BYTES + 8 * w for w in range(8, 10_000) if (b[HEADER_BYTES + 8 * w] >> 3 & 1) == v)
              for v in (0, 1)]
        for x in at:
            b[x] ^= 0x08
    elif how in ("swapped_words", "swapped_rows"):   # two 8-byte words / two 576-byte rows of one range
        n = 8 if how == "swapped_words" else 576
        x, y = HEADER_BYTES + n, HEADER_BYTES + 5 * n
        assert b[x:x + n] != b[y:y + n]
        b[x:x + n], b[y:y + n] = b[y:y + n], b[x:x + n]
    else:
        del b[-8:]
    return bytes(b)


@pytest.mark.parametrize("how", ["stale", "foreign", "corrupt", "size_mismatch", "compensating", "swapped_words",
                                 "swapped_rows"])
def test_a_damaged_value_is_a_miss_with_its_reason_and_is_never_restored(servers, how):
    s = reader(servers.url)
    seq = prompts(SEEDS[how])[0]
    store, k = s.link.shared.store, key(s, "page", seq, 0)
    store.raw_put(k, _damage(store.raw_get(k), how))
    assert admit_only(s, seq) == 0              # nothing restored: computed cold
    assert s.link.tier.snapshot().groups["pages"].units_used == 0
    snap = s.close()
    want = how if how in ("stale", "foreign", "corrupt", "size_mismatch") else "corrupt"
    assert snap.misses["page"][want] == 1 and snap.hit_tokens == 0


def test_eviction_under_a_small_store(servers, tmp_path):
    """Twice what the store holds, put through the tier: the oldest go (misses: absent), no
    call fails, and every value still there reads back exactly."""
    from kvatlas.tiers.shared import Entry, SharedTier
    from kvatlas.tiers.shared.values import Layout
    # (16 MB: the smallest segment Mooncake's memory daemon takes)
    srv = start(servers.kind, tmp_path, **({"segment": "16MB"} if servers.kind == "mooncake" else {"maxmemory": "16mb"}))
    try:
        store = open_store(srv.url)
        n, size = 256, 128 << 10          # 256 values of 128 KiB: 32 MiB into 16 MB
        src = np.random.default_rng(0).integers(0, 256, (n, size), dtype=np.uint8)
        dst = np.zeros_like(src)
        store.register(src)
        store.register(dst)
        # a deadline far past any read here: this test is about eviction (a 32 MiB get on a loaded
        # 2-core machine can take longer than the default 500 ms, which is the deadline test's subject)
        tier = SharedTier(store, Layout(namespace="evict", layout_hash=7, payload_bytes={"page": size, "checkpoint": 8}),
                          deadline_s=30.0)
        for i in range(0, n, 8):
            tier.put([Entry("page", k, 0, (src[k],)) for k in range(i, i + 8)])
            tier.flush(30.0)
        got = tier.get([Entry("page", k, 0, (dst[k],)) for k in range(n)]).reasons
        snap = tier.snapshot()
        assert sum(snap.errors.values()) == 0 and snap.puts["page"]["failed"] == 0
        # what no longer fits was evicted (Redis: LRU by sampling) or refused (Mooncake evicts in the
        # background, so a burst meets "no room": counted as `full`, not as a failure)
        hit = [k for k, r in enumerate(got) if r is None]
        assert set(got) <= {None, "absent"} and n // 8 <= len(hit) <= (16 << 20) // size, got
        assert snap.puts["page"]["stored"] + snap.puts["page"]["full"] == n
        assert np.array_equal(dst[hit], src[hit]) and snap.misses["page"]["absent"] == got.count("absent")
        tier.close()
    finally:
        srv.stop()


def test_a_full_redis_is_full_not_failed_and_its_puts_land_once_there_is_room(tmp_path):
    """A Redis at its maxmemory with `noeviction` refuses every SET (redis-py raises its
    OutOfMemoryError): the puts count as `full`, not as failures (no error, the breaker stays
    closed) and nothing is known; once Redis has room, the same prompt finishing again puts them,
    and another cache restores them."""
    import redis
    srv = start("redis", tmp_path, maxmemory="1", policy="noeviction")   # 1 byte: every write refused
    try:
        w = Writer(srv.url)
        seq = prompts(120)[0]
        w.run(seq)
        w.link.shared.flush(10.0)
        snap = w.link.shared_snapshot()
        assert (snap.puts["page"]["full"], snap.puts["checkpoint"]["full"]) == (2, 1), snap.puts
        assert snap.puts["page"]["failed"] == 0 and sum(snap.errors.values()) == 0 and not snap.breaker_open
        redis.Redis(host=ss.LOOPBACK, port=srv.port).config_set("maxmemory", 0)    # room again
        assert w.run(seq) == 512
        w.link.shared.flush(10.0)
        snap = w.link.shared_snapshot()
        assert (snap.puts["page"]["stored"], snap.puts["checkpoint"]["stored"]) == (2, 1), snap.puts
        w.close()
        r = reader(srv.url)
        assert admit_only(r, seq) == 512
        r.close()
    finally:
        srv.stop()


def test_a_store_killed_mid_run_means_misses_then_recovery(servers, tmp_path):
    """Kill the store (redis-server; Mooncake's memory daemon, then its master) under a reader:
    every prefetch returns within the deadline with a miss, the breaker opens; after a restart
    the tiers recover by themselves (a write, then a hit in another cache)."""
    srv = start(servers.kind, tmp_path)
    deadline = 0.3
    try:
        victims = [srv.server] if servers.kind == "redis" else [srv.daemon, srv.master]
        for n, victim in enumerate(victims):
            seqs = [prompts(300 + 10 * n + x)[0] for x in range(2)]
            write_through(srv.url, seqs)                 # in the store: existence says yes
            s = reader(srv.url, deadline_s=deadline, breaker=Breaker(cooloff_s=0.5))
            victim.kill()
            for seq in seqs * 2:                         # serving goes on: every prefetch bounded
                t = time.monotonic()
                assert s.link.prefetch(len(seq), token_ids=seq) is None
                assert time.monotonic() - t < 2 * deadline + 0.5
            snap = s.link.shared_snapshot()
            assert snap.breaker_opened >= 1
            assert sum(m["tier_unavailable"] + m["deadline"] for m in snap.misses.values()) >= 1
            assert sum(snap.errors.values()) >= 1 and snap.hit_tokens == 0
            victim.start()
            ok, end, seed = False, time.monotonic() + 40, 400 + 50 * n
            while not ok and time.monotonic() < end:    # recovery by itself: a write, then a hit elsewhere
                seed += 1
                _, w = write_through(srv.url, [prompts(seed)[0]])
                if w.puts["page"]["stored"] == 2:
                    ok = admit_only(s, prompts(seed)[0]) == 512   # the same reader, its breaker closed again
                else:
                    time.sleep(0.5)
            assert ok, f"no recovery within 40 s after {victim.args[0]} restarted"
            assert not s.link.shared_snapshot().breaker_open
            s.close()
    finally:
        srv.stop()


# ------------------------------------------------------------------ credentials and start-up (issues 33, 38)
def test_redis_with_a_password_in_the_url(tmp_path):
    """A protected redis-server: with the password in the URL (percent-encoded characters and
    all) a prefix written by one cache is a hit in another; without it, or with a wrong one, or a
    database the server does not have, the store is refused with what is wrong, the password
    never shown; the CLI says it in one line, exit 2."""
    from kvatlas.cli import main
    from kvatlas.errors import ConfigError
    password = "s3cr@t:/#%x"
    srv = ss.Redis(tmp_path, password=password).start()
    try:
        good, bare = srv.url, f"redis://{ss.LOOPBACK}:{srv.port}?timeout=1"
        seq = prompts(120)[0]
        write_through(good, [seq])
        s = reader(good)
        assert admit_only(s, seq) == 512
        assert sum(s.close().errors.values()) == 0
        assert admit_only_fresh(good.replace("redis://", "redis://default"), seq) == 512   # the ACL user, named
        cases = [(bare, "needs a password (NOAUTH)"), (good.replace("%40", "%41"), "refused the credentials"),
                 (good.replace("?timeout", "/99999?timeout"), "has no database 99999")]
        for url, words in cases:
            with pytest.raises(ConfigError, match=re.escape(words)) as e:
                open_store(url, "--shared-tier")
            assert e.value.field == "--shared-tier" and "s3cr" not in str(e.value)
        argv = ["simulate", "tiny-v4", "--memory", "64MiB", "--max-running-requests", "4", "--prefix-checkpoints",
                "4", "--host-memory", "8MiB", "--write-layers", "0", "--duration", "0.5", "--no-plot", "--out",
                str(tmp_path / "run"), "--shared-tier"]
        r = subprocess.run([sys.executable, "-m", "kvatlas", *argv, bare], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith("kvatlas simulate: error: --shared-tier: redis ") and "NOAUTH" in r.stderr
        assert "redis://:PASSWORD@HOST:PORT" in r.stderr and "Traceback" not in r.stderr
        r = subprocess.run([sys.executable, "-m", "kvatlas", *argv, good.replace("?timeout", "/99999?timeout")],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith("kvatlas simulate: error: --shared-tier: redis ") and "no database 99999" in r.stderr
        assert "s3cr" not in r.stderr
        r = subprocess.run([sys.executable, "-m", "kvatlas", *argv, good], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        line = next(x for x in r.stdout.splitlines() if x.startswith("shared tier"))
        assert "errors 0" in line and "tier_unavailable" not in line and "s3cr" not in r.stdout + r.stderr
    finally:
        srv.stop()


def admit_only_fresh(url, seq) -> int:
    s = reader(url)
    try:
        return admit_only(s, seq)
    finally:
        s.close()


class SlowProxy:
    """A TCP proxy on 127.0.0.1 to `port` that holds every chunk `delay_s` before passing it on
    (a master that answers, slowly): threads of this process, closed by the test."""

    def __init__(self, port: int, delay_s: float = 2.0) -> None:
        import socket
        import threading
        self.target, self.delay_s, self.socks = port, delay_s, []
        self.sock = socket.socket()
        self.sock.bind((ss.LOOPBACK, 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading
        while not self.closed:
            try:
                a = self.sock.accept()[0]
                b = socket.create_connection((ss.LOOPBACK, self.target))
            except OSError:
                return
            self.socks += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src, dst) -> None:
        while not self.closed:
            try:
                data = src.recv(65536)
                if not data:
                    return
                time.sleep(self.delay_s)
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.closed = True
        for s in [self.sock, *self.socks]:
            s.close()


def test_serve_with_a_slow_mooncake_master_answers_at_once_and_stops_on_sigterm(tmp_path):
    """A master behind a proxy that delays every chunk 2 s (its setup would take minutes):
    `serve` answers /healthz within seconds, serves with misses (`tier_unavailable`) past its
    start-up bound, and stops with status 0 and its summary on SIGTERM; beside it, the same
    master reached directly opens within the bound."""
    st = test_shared_startup
    srv = start("mooncake", tmp_path)
    proxy = SlowProxy(srv.rpc)
    try:
        slow = srv.url.replace(f":{srv.rpc}?", f":{proxy.port}?")
        s = st.Serve("--host-memory", "8MiB", "--shared-tier", slow, "--shared-startup-s", "2")
        took, _ = s.healthz()
        end, doc = time.monotonic() + 60, None
        while time.monotonic() < end and doc is None:
            code, body = st._get(s.url + "/state")
            if code == 200:
                doc = json.loads(body)["caches"][0]["shared_tier"]
            time.sleep(0.2)
        rc, out, err, stop_s = s.stop()
        assert took < 20 and doc is not None and "not open" in doc["store"], (took, doc)
        assert rc == 0 and "stopped by SIGTERM; endpoint closed" in out and stop_s < 15, err[-2000:]
        t = time.monotonic()
        store = open_store(srv.url, startup_s=20)
        assert store.ready and time.monotonic() - t < 20 and store.describe() == f"mooncake master 127.0.0.1:{srv.rpc}"
        store.close()
    finally:
        proxy.close()
        srv.stop()


def test_redis_over_tls(tmp_path):
    """rediss:// with the server's CA: a value put through the tier reads back exactly; without
    the CA the store is refused at start-up, saying the certificate is not trusted."""
    import shutil
    from kvatlas.errors import ConfigError
    from kvatlas.tiers.shared import Entry, SharedTier
    from kvatlas.tiers.shared.values import Layout
    if shutil.which("openssl") is None:
        ss.missing("openssl is not installed (it makes the test's certificate)")
    ca, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(ca),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    port = ss.free_port()
    srv = ss.Server([ss._bin("redis-server"), "--bind", ss.LOOPBACK, "--port", "0", "--tls-port", str(port),
                     "--tls-cert-file", str(ca), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
                     "--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                    port, open(tmp_path / "redis-tls.log", "ab")).start()
    try:
        url = f"rediss://{ss.LOOPBACK}:{port}?timeout=2&ca={ca}"
        store = open_store(url, startup_s=20)
        assert store.ready and store.describe().endswith("(TLS)")
        tier = SharedTier(store, Layout(namespace="tls", layout_hash=5, payload_bytes={"page": 4096, "checkpoint": 8}),
                          deadline_s=10.0)
        src, dst = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8), np.zeros(4096, np.uint8)
        assert tier.put([Entry("page", 9, 0, (src,))])
        tier.flush(10.0)
        assert tier.get([Entry("page", 9, 0, (dst,))]).reasons == [None] and np.array_equal(dst, src)
        tier.close()
        with pytest.raises(ConfigError, match="certificate is not trusted") as e:
            open_store(url.split("&ca=")[0], "--shared-tier", startup_s=20)
        assert "?ca=CA_FILE" in str(e.value)
    finally:
        srv.stop()
