"""The endpoint server over real HTTP on loopback: /metrics parsed as Prometheus would, /state,
/healthz, a port in use, clean close, and `kvatlas serve` stopped by SIGTERM."""

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

import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvatlas
from kvatlas import server
from kvatlas.errors import KvatlasError
from kvatlas.cache.ledger import MEASURES
from kvatlas.driving.sim import Simulator
from kvatlas.driving.workload import synthetic

PLAN = dict(max_running_requests=8, max_model_len=2048, chunked_prefill_tokens=512)


@pytest.fixture()
def cache():
    return kvatlas.allocate(kvatlas.plan("tiny-v4", "96MiB", **PLAN))


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def scrape_bytes(url: str) -> dict:
    """(pool, measure) → value of kvatlas_kv_cache_bytes, over HTTP."""
    status, ctype, body = get(url + "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    return {(s.labels["pool"], s.labels["measure"]): s.value for s in fams["kvatlas_kv_cache_bytes"].samples}


def ledger_bytes(cache) -> dict:
    snap = cache.ledger.snapshot()
    return {(p, m): getattr(u.measures, f"{m}_bytes") for p, u in snap.pools.items() for m in MEASURES}


def test_metrics_state_healthz_over_http(cache):
    cache.admit("req-1", 300, 20)
    cache.extend("req-1", 300)
    with server.start(cache) as h:
        assert h.host == "127.0.0.1" and h.port > 0
        assert scrape_bytes(h.url) == ledger_bytes(cache)
        status, ctype, body = get(h.url + "/state")
        assert status == 200 and ctype == "application/json"
        doc = json.loads(body)
        assert doc["schema"] == "kvatlas.state" and doc["schema_version"] == server.STATE_SCHEMA_VERSION
        (c,) = doc["caches"]
        snap = cache.ledger.snapshot()
        assert c["ledger"] == json.loads(json.dumps(snap.to_dict()))
        assert c["plan"]["schema"] == "kvatlas.plan" and c["plan"]["total_bytes"] == cache.plan.total_bytes
        assert c["requests"]["req-1"]["pools"] == cache.request_usage("req-1")
        assert get(h.url + "/healthz")[:1] == (200,)
        assert get(h.url + "/nope")[0] == 404


def test_port_in_use_is_a_clear_error(cache):
    with server.start(cache) as h:
        with pytest.raises(KvatlasError, match=rf"port: 127.0.0.1:{h.port} is already in use.*port=0 picks a free one"):
            server.start(cache, port=h.port)
    with pytest.raises(KvatlasError, match="port"):
        server.start(cache, port=70000)


def test_close_releases_the_socket(cache):
    h = server.start(cache)
    h.close()
    h.close()   # idempotent
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", h.port), timeout=1).close()
    server.start(cache, port=h.port).close()   # the port can be bound again


def test_scrapes_follow_the_workload_up_and_back_to_zero(cache):
    """A driver thread mutates the cache under the lock while the test scrapes over HTTP: every
    scrape equals the ledger at that moment (taken under the same lock), occupied rises and falls."""
    lock = threading.Lock()
    reqs = synthetic(rate_per_s=40, duration_s=0.5, prompt="uniform:16:600", output="uniform:2:40", seed=5)
    sim = Simulator(cache, reqs, lock=lock, record=False)
    seen = []
    with server.start(cache, lock=lock, extra_state=sim.state, request_state=sim.progress) as h:
        t = 0.0
        while not sim.done:
            sim.step(t)
            t += 0.02
            with lock:   # the scrape takes the lock too, so the ledger cannot move in between
                want = ledger_bytes(cache)
            got = scrape_bytes(h.url)
            assert got == want
            seen.append(sum(v for (p, m), v in got.items() if m == "occupied"))
        doc = json.loads(get(h.url + "/state")[2])
        assert doc["workload"]["done"] and doc["workload"]["stats"]["finished"] == len(reqs)
        assert doc["caches"][0]["requests"] == {}
    assert max(seen) > 0 and seen[-1] == 0
    assert any(b < a for a, b in zip(seen, seen[1:]))


def test_state_lists_running_requests_with_progress(cache):
    reqs = synthetic(rate_per_s=50, duration_s=0.2, prompt="300", output="50", seed=1)
    sim = Simulator(cache, reqs)
    with server.start(cache, extra_state=sim.state, request_state=sim.progress) as h:
        sim.step(1.0)
        doc = json.loads(get(h.url + "/state")[2])
    reqs_doc = doc["caches"][0]["requests"]
    assert set(reqs_doc) == set(sim.running) and reqs_doc
    r = next(iter(reqs_doc.values()))
    assert r["prompt_tokens"] == 300 and r["prefilled_tokens"] > 0 and "c4_kv" in r["pools"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_cli_stops_cleanly_on_a_signal(sig):
    cmd = [sys.executable, "-m", "kvatlas", "serve", "tiny-v4", "--memory", "96MiB", "--max-model-len", "2048",
           "--max-running-requests", "8", "--chunked-prefill-tokens", "512", "--port", "0", "--rate", "20",
           "--duration", "30", "--prompt-len", "uniform:16:300", "--output-len", "uniform:2:30",
           "--write-layers", "0", "--progress-s", "0.5"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        url = line.split("endpoints at ", 1)[1].split("/metrics", 1)[0]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and json.loads(get(url + "/state")[2])["workload"]["stats"]["steps"] < 3:
            time.sleep(0.2)
        assert get(url + "/healthz")[0] == 200
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == (130 if sig == signal.SIGINT else 0), err   # interrupted, or stopped as a service
    assert f"stopped by {sig.name}; endpoint closed" in out and "summary" in out
    port = int(url.rsplit(":", 1)[1])
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_serve_cli_port_in_use(cache, capsys):
    from kvatlas.cli import main
    with server.start(cache) as h:
        rc = main(["serve", "tiny-v4", "--memory", "96MiB", "--max-model-len", "2048", "--max-running-requests", "8",
                   "--port", str(h.port), "--duration", "1"])
    assert rc == 2 and "already in use" in capsys.readouterr().err


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_ipv6_loopback_is_served(cache):
    with server.start(cache, host="::1", port=0) as h:
        assert h.url.startswith("http://[::1]:")
        assert get(h.url + "/healthz")[0] == 200
