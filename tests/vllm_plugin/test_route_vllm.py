"""`kvatlas route` over HTTP in front of two of vLLM's real engine cores (tests/route_vllm_replica.py:
the engine core's scheduler, KV cache manager and ZMQ KV-event publisher, behind a minimal
OpenAI-style server): every answer's engine-reported cached tokens equal what the router predicted
for the replica that served it (its /score just before, and its /metrics histogram), requests that
share a document go where it is, and a reset (`AllBlocksCleared`) takes the prediction to 0."""

import json
import os
import random
import signal
import sys
import urllib.request

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
pytest.importorskip("aiohttp")
pytest.importorskip("zmq")
from route_fleet import Router, _ready_line, free_ports, get, metric, post, wait_for   # noqa: E402

SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "route_vllm_replica.py")


class Engine:
    def __init__(self, name):
        self.name = name
        self.http, self.events, self.replay = free_ports(3)
        self.proc = None

    def spawn(self):
        import subprocess
        self.proc = subprocess.Popen([sys.executable, SERVER, "--http-port", str(self.http), "--events-port",
                                      str(self.events), "--replay-port", str(self.replay), "--memory", "4GiB"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)   # its own group: vLLM's helper processes die with it
        return self

    @property
    def url(self):
        return f"http://127.0.0.1:{self.http}"

    def flag(self):
        return f"{self.url}=tcp://127.0.0.1:{self.events},replay=tcp://127.0.0.1:{self.replay},name={self.name},bind"

    def stop(self):
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def cluster():
    engines = [Engine(f"v{i}") for i in range(2)]
    router = None
    try:
        for e in engines:
            e.spawn()
        for e in engines:
            _ready_line(e.proc, f"engine {e.name}", 900)
        router = Router([e.flag() for e in engines], "--health-interval-s", "0.5")
        wait_for("engines up", lambda: all(r["up"] for r in get(router.url + "/state")["replicas"]), 30)
        yield router, engines
    finally:
        if router is not None:
            rc, _, err = router.stop()
            assert rc == 0 and "Traceback" not in err, err
        for e in engines:
            e.stop()


def doc(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(100, 50000) for _ in range(n)]


def ask(router, ids):
    score = post(router.url + "/score", {"prompt": ids})[1]
    status, body, headers = post(router.url + "/v1/completions", {"prompt": ids, "max_tokens": 2}, timeout=120)
    assert status == 200, body
    served = headers["X-Kvatlas-Replica"]
    predicted = next(c["device_tokens"] for c in score["candidates"] if c["replica"] == served)
    return served, predicted, body["usage"]["prompt_tokens_details"]["cached_tokens"], score


def held(router, ids, name):
    return next(c["device_tokens"] for c in post(router.url + "/score", {"prompt": ids})[1]["candidates"]
                if c["replica"] == name)


def test_predictions_equal_the_engines_cached_tokens_over_http(cluster):
    router, engines = cluster
    docs = [doc(k, 1300) for k in range(3)]
    first = {}
    rows = []
    for k, d in enumerate(docs):                   # each document's first request stores it on one engine
        served, predicted, cached, _ = ask(router, d + doc(100 + k, 50))
        first[k] = served
        rows.append((predicted, cached))
        wait_for(f"{served}'s events applied", lambda: held(router, d + [1], served) > 0, 15)
    for q in range(9):                             # then follow-ups: each resumes from its document
        k = q % 3
        served, predicted, cached, score = ask(router, docs[k] + doc(200 + q, 60))
        assert served == first[k], score           # sent where the document is
        assert predicted == cached > 0, (predicted, cached)
        rows.append((predicted, cached))
    assert all(p == c for p, c in rows), rows
    m = get(router.url + "/metrics")
    n = metric(m, "kvatlas_route_prediction_error_tokens_count")
    exact = metric(m, "kvatlas_route_prediction_error_tokens_bucket", le="0.0") - \
        metric(m, "kvatlas_route_prediction_error_tokens_bucket", le="-1.0")
    assert n == len(rows) and exact == n
    assert metric(m, "kvatlas_route_engine_cached_tokens_total") == sum(c for _, c in rows)
    # vLLM's own reset: AllBlocksCleared on the wire, the router predicts nothing there any more
    name = first[0]
    e = next(x for x in engines if x.name == name)
    req = urllib.request.Request(e.url + "/_reset", data=b"{}", method="POST")
    assert json.loads(urllib.request.urlopen(req, timeout=60).read())["reset"] is True
    wait_for(f"{name}'s reset applied", lambda: held(router, docs[0] + [1], name) == 0, 15)
    served, predicted, cached, _ = ask(router, docs[0] + [5, 6, 7])
    assert predicted == cached
