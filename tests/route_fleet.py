"""Fake vLLM replicas (tests/route_fake.py) and a `kvatlas route` in front of them, each its own
process on loopback, for the router's end-to-end tests and bench. Every process is stopped by its
PID; every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE = os.path.join(HERE, "route_fake.py")


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ready_line(proc: subprocess.Popen, what: str, timeout_s: float) -> str:
    """The first stdout line of a process that prints one when ready (bounded by timeout_s)."""
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sel.select(timeout=0.2):
            line = proc.stdout.readline()
            if line:
                return line
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {proc.stderr.read()}")
    proc.kill()
    raise RuntimeError(f"{what} not ready within {timeout_s} s")


class Fake:
    """One fake replica on fixed ports, so it can be killed and started again where it was."""

    def __init__(self, name: str, tokenizer: str | None = None, **opts) -> None:
        self.name = name
        self.http_port, self.events_port, self.replay_port = free_ports(3)
        self.tokenizer, self.opts = tokenizer, opts
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def replica_flag(self) -> str:
        return (f"{self.url}=tcp://127.0.0.1:{self.events_port},replay=tcp://127.0.0.1:{self.replay_port},"
                f"name={self.name}")

    def start(self) -> "Fake":
        return self.spawn().ready()

    def spawn(self) -> "Fake":
        """Start the process without waiting (start several, then `ready()` each)."""
        argv = [sys.executable, FAKE, "--http-port", str(self.http_port), "--events-port", str(self.events_port),
                "--replay-port", str(self.replay_port)]
        if self.tokenizer:
            argv += ["--tokenizer", self.tokenizer]
        for k, v in self.opts.items():
            argv += [f"--{k.replace('_', '-')}", str(v)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return self

    def ready(self) -> "Fake":
        _ready_line(self.proc, f"fake replica {self.name}", 180)
        return self

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def faults(self, **f) -> dict:
        return post(self.url + "/_fake/faults", f)[1]

    def info(self) -> dict:
        return get(self.url + "/_fake/info")


class Router:
    """`python -m kvatlas route` as a subprocess."""

    def __init__(self, replicas: list[str], *args: str, model: str = "deepseek-v4-flash") -> None:
        self.port = free_ports(1)[0]
        argv = [sys.executable, "-m", "kvatlas", "route", model, "--port", str(self.port), *args]
        for r in replicas:
            argv += ["--replica", r]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        line = _ready_line(self.proc, "kvatlas route", 180)
        assert "listening at" in line, line
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> tuple[int, str, str]:
        """SIGTERM; (exit status, stdout, stderr)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            out, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        return self.proc.returncode, out, err


def post(url: str, body, timeout: float = 30.0, headers=None) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def get(url: str, timeout: float = 30.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        raw = r.read()
        return json.loads(raw) if r.headers.get("Content-Type", "").startswith("application/json") else raw.decode()


def stream(url: str, body: dict, timeout: float = 30.0) -> list[tuple[float, bytes]]:
    """(seconds since the request was sent, bytes) for each read of a streamed answer."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    out = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        while True:
            chunk = r.read1(65536)
            if not chunk:
                break
            out.append((time.monotonic() - t0, chunk))
    return out


def wait_for(what: str, cond, timeout_s: float, every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def metric(text: str, name: str, **labels) -> float:
    """The sum of the samples of `name` whose labels include `labels`, in a /metrics text (0.0: none)."""
    from prometheus_client.parser import text_string_to_metric_families
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def tiny_tokenizer(folder: str) -> str:
    """A word-level tokenizer with a chat template, saved as a model directory's tokenizer files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"] + [f"w{i}" for i in range(2000)]
    words += ["hello", "world", "the", "cache", "is", "warm", "."]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    fast.save_pretrained(folder)
    return folder


def route_registry():
    """A router's metrics registry with every family written, as a router fills it (two replicas, one
    taken out and stale), for the dashboard's tests."""
    from kvatlas.routing.metrics import RouteMetrics
    from kvatlas.routing.replicas import ReplicaState, parse_replica
    a, b = (ReplicaState(spec=parse_replica(f"http://127.0.0.1:{p}=tcp://127.0.0.1:{p + 1},name={n}", 0))
            for p, n in ((1000, "a"), (2000, "b")))
    b.take_out("refused")
    a.in_flight = 2
    ranks = [{"replica": "a", "dp_rank": 0, "lag_s": 0.004, "batches": 40, "gaps": 1, "replays": 1, "malformed": 0,
              "stale": False},
             {"replica": "b", "dp_rank": 0, "lag_s": 12.5, "batches": 7, "gaps": 0, "replays": 0, "malformed": 2,
              "stale": True}]
    m = RouteMetrics(lambda: ([a, b], ranks))
    m.requests.labels("a", "prefix").inc(3)
    m.requests.labels("b", "load").inc()
    m.requests.labels("a", "retry").inc()
    m.failures.labels("b", "refused").inc()
    m.unserved.inc(0)
    for predicted, cached, expected in ((512, 512, 512), (0, 256, 256), (1024, 1024, 1024)):
        m.observe_usage("a", predicted, cached, 1500, expected)
    m.routing.observe(0.0004)
    m.held.labels("a").inc(2)
    m.hold.observe(0.8)
    return m.registry
