"""`kvatlas serve` under 8 concurrent scrapers: every /state is one consistent snapshot (its
running-request count, its request list, the workload's count and the per-request bytes agree
with its own ledger), HEAD works, and clients that vanish mid-request leave no traceback."""

import json
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

pytest.importorskip("torch")

SERVE = ["serve", "tiny-v4", "--memory", "96MiB", "--max-running-requests", "8", "--max-model-len", "2048",
         "--chunked-prefill-tokens", "512", "--draft-tokens", "2", "--rate", "30", "--duration", "60",
         "--prompt-len", "uniform:16:600", "--output-len", "uniform:8:120", "--step-ms", "5", "--port", "0",
         "--progress-s", "3600"]
PAGED = ("swa_kv", "c4_kv", "c4_indexer", "c128_kv")


def get(url, method="GET"):
    req = urllib.request.Request(url, method=method)
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, dict(r.headers), r.read()


def check_consistent(doc) -> int:
    c = doc["caches"][0]
    ledger, reqs = c["ledger"], c["requests"]
    running = ledger["running_requests"]
    assert len(reqs) == running == doc["workload"]["running"], (running, len(reqs), doc["workload"]["running"])
    for pool in PAGED:   # the requests' live bytes add up to the ledger's occupied bytes, pool by pool
        if pool in ledger["pools"]:
            total = sum(r["pools"][pool]["occupied_bytes"] for r in reqs.values())
            assert total == ledger["pools"][pool]["occupied"], pool
    for r in reqs.values():
        assert 0 <= r["prefilled_tokens"] <= r["prompt_tokens"] and r["generated_tokens"] <= r["output_tokens"]
    return running


def rude_clients(host: str, port: int) -> None:
    """Disconnect in the middle: before sending, after sending (reset, no read), mid-headers."""
    for payload in (b"", b"GET /state HTTP/1.0\r\n\r\n", b"GET /met", b"HEAD /metrics HTTP/1.0\r\n\r\n"):
        s = socket.create_connection((host, port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # close = reset
        if payload:
            s.sendall(payload)
        s.close()


def test_eight_scrapers_see_consistent_state():
    proc = subprocess.Popen([sys.executable, "-m", "kvatlas", *SERVE], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        url = re.search(r"endpoints at (http://\S+?)/metrics", line).group(1)
        host, port = url[len("http://"):].rsplit(":", 1)
        docs, errors, stop = [], [], threading.Event()

        def scrape():
            while not stop.is_set():
                try:
                    docs.append(json.loads(get(url + "/state")[2]))
                except Exception as exc:  # noqa: BLE001: reported below
                    errors.append(repr(exc))

        threads = [threading.Thread(target=scrape) for _ in range(8)]
        for t in threads:
            t.start()
        time.sleep(1.5)
        rude_clients(host, int(port))
        time.sleep(2.5)
        stop.set()
        for t in threads:
            t.join()
        status, headers, body = get(url + "/metrics", method="HEAD")
        assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0
        assert get(url + "/healthz", method="HEAD")[0] == 200
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    assert not errors, errors[:3]
    assert len(docs) >= 10, len(docs)   # at least; on a quiet machine hundreds
    running = [check_consistent(d) for d in docs]
    assert max(running) >= 2   # the scrapes saw a busy cache, not only an idle one
    assert "Traceback" not in err and "Exception" not in err, err[-2000:]
    assert proc.returncode == 0 and "stopped by SIGTERM" in out
