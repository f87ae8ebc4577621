"""End to end: a real Prometheus server (Debian's `prometheus` package) scrapes `kvatlas serve` on
loopback every second; its HTTP API must return the same kvatlas_kv_cache_bytes as /state.

Skipped, saying so, when the prometheus binary is not installed (.ci/run tries to install it).
Every wait is bounded; the whole test takes well under 60 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from kvatlas.cache.ledger import MEASURES

PROMETHEUS = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus binary not found: install Debian's "
                                "'prometheus' package (apt-get install prometheus) to run this end-to-end test")

SERVE = ["tiny-v4", "--memory", "96MiB", "--max-model-len", "2048", "--max-running-requests", "8",
         "--chunked-prefill-tokens", "512", "--draft-tokens", "1", "--rate", "6", "--duration", "6",
         "--prompt-len", "uniform:32:600", "--output-len", "uniform:20:80", "--write-layers", "1",
         "--linger", "-1", "--progress-s", "5"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def wait_for(what: str, fn, timeout_s: float, every_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = fn()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def query(prom: str, q: str) -> list:
    doc = get_json(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": q}))
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


@contextlib.contextmanager
def running_prometheus(tmp_path, target_port: int, rule_files=(), more_jobs=None):
    """A Prometheus on loopback scraping 127.0.0.1:target_port (job kvatlas), and each port of
    `more_jobs` ({job: port}), every second (rules evaluated every second too); yields its URL
    once ready, and stops it by its PID."""
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    rules = "rule_files:\n" + "".join(f"  - {json.dumps(str(f))}\n" for f in rule_files) if rule_files else ""
    jobs = {"kvatlas": target_port, **(more_jobs or {})}
    cfg.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n" + rules + "scrape_configs:\n" +
                   "".join(f"  - job_name: {job}\n    static_configs:\n      - targets: ['127.0.0.1:{p}']\n"
                           for job, p in jobs.items()))
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    prom = f"http://127.0.0.1:{port}"
    try:
        wait_for("Prometheus to be ready", lambda: urllib.request.urlopen(f"{prom}/-/ready", timeout=2).status == 200,
                 20)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture()
def prometheus(tmp_path):
    """Prometheus first, scraping a port `kvatlas serve` will take: it scrapes from the serve's
    first second on, so it sees the workload from its start."""
    serve_port = free_port()
    with running_prometheus(tmp_path, serve_port) as prom:
        yield prom, serve_port


@pytest.fixture()
def serve(prometheus):
    _, port = prometheus
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvatlas", "serve", *SERVE, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "endpoints at " in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        yield proc, line.split("endpoints at ", 1)[1].split("/metrics", 1)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def by_pool_measure(result: list) -> dict:
    return {(r["metric"]["pool"], r["metric"]["measure"]): float(r["value"][1]) for r in result}


def test_prometheus_scrapes_kvatlas_serve(prometheus, serve):
    proc, url = serve
    prom, _ = prometheus
    wait_for("a first scrape", lambda: query(prom, 'up{job="kvatlas"} == 1'), 15)
    wait_for("the workload to finish", lambda: get_json(url + "/state")["workload"]["done"], 30)
    done_at = time.time()
    # a scrape that started after the workload ended: its samples carry a later timestamp
    wait_for("a scrape after the workload ended",
             lambda: query(prom, f"min(timestamp(kvatlas_kv_cache_bytes)) > {done_at + 0.1}"), 10)
    scraped = by_pool_measure(query(prom, "kvatlas_kv_cache_bytes"))
    ledger = get_json(url + "/state")["caches"][0]["ledger"]
    want = {(pool, m): float(v[m]) for pool, v in ledger["pools"].items()
            for m in MEASURES}
    assert scraped == want
    assert ledger["totals"]["occupied"] == 0 and ledger["running_requests"] == 0
    # while the workload ran, Prometheus saw memory occupied, and saw it fall back to 0
    peak = query(prom, 'max_over_time(kvatlas_kv_cache_total_bytes{measure="occupied"}[5m])')
    assert float(peak[0]["value"][1]) > 0
    info = query(prom, "kvatlas_info")
    assert info[0]["metric"]["model"] == "tiny-v4" and info[0]["metric"]["layout"] == "v4"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "stopped by SIGTERM; endpoint closed" in out
