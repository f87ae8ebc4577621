"""`kvatlas route` end to end over HTTP in front of N vLLM engine cores, the Mooncake trace replayed
at its timestamps (issue 37).

Each replica is vLLM's real engine core (scheduler, hybrid KV cache manager, ZMQ KV-event publisher
with a replay socket; the offline executor) behind a minimal OpenAI-style server
(tests/route_vllm_replica.py says why not vLLM's own server), each its own process on loopback, with
the KV budget of one V4-Flash rank (`--memory`). Each step takes kvatlas's default time model's time
for the tokens it computes, so a replica is busy as long as a GPU would be.

For each policy: every replica's cache is emptied (`reset_prefix_cache`: vLLM publishes
`AllBlocksCleared`), a fresh `kvatlas route --policy P` is started in front, and an HTTP client sends
the trace's first `--requests` requests at their timestamps (token ids from the trace's block ids;
`max_tokens` = the trace's output length, capped). Before each request the client asks the router's
`POST /score` what it predicts (kvatlas's device tokens and the full group's alone) for every replica;
the answer's `X-Kvatlas-Replica` and `usage.prompt_tokens_details.cached_tokens` (the engine's own
count) then say which replica served it and what it really resumed. Per policy:

- cluster hit ratio: engines' cached tokens / prompt tokens, over the run;
- exactness: the share of requests whose predicted device tokens (router's /metrics histogram
  `kvatlas_route_prediction_error_tokens`, and the /score answer just before) equal the engine's
  count — resident at routing time, and expected including the prefixes in flight there
  (`kvatlas_route_expected_error_tokens`, /score's `expected_tokens`); and the same for the full
  group alone (what `main_group_prefix` scores), with its mean over-prediction;
- the router's own routing time (tokenize + predict + score; its /metrics histogram) p50/p99;
- every request answered (HTTP 200), the router's exit status.

    python bench/route_vllm.py --trace TRACE.jsonl [--start 0] [--requests 120] [--replicas 4] [--memory 32GiB]
        [--policies kvatlas,main_group_prefix,round_robin,least_loaded] [--max-tokens 16] [--weights N=V,...]
        [--hold-s S] [--json FILE]

Run it with a Python that has vLLM 0.34 and kvatlas (PYTHONPATH=src from a checkout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from route_fleet import _ready_line, free_ports, get, metric   # noqa: E402

POLICIES = "kvatlas,main_group_prefix,round_robin,least_loaded"
SERVER = ROOT / "tests" / "route_vllm_replica.py"


class Replica:
    def __init__(self, name: str, memory: str, model: str) -> None:
        self.name, self.memory, self.model = name, memory, model
        self.http_port, self.events_port, self.replay_port = free_ports(3)
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def flag(self) -> str:
        return (f"{self.url}=tcp://127.0.0.1:{self.events_port},replay=tcp://127.0.0.1:{self.replay_port},"
                f"name={self.name},bind")

    def spawn(self) -> "Replica":
        self.proc = subprocess.Popen([sys.executable, str(SERVER), "--http-port", str(self.http_port),
                                      "--events-port", str(self.events_port), "--replay-port", str(self.replay_port),
                                      "--memory", self.memory, "--model", self.model, "--pass-time"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)   # its own group: vLLM's helper processes die with it
        return self

    def ready(self) -> None:
        _ready_line(self.proc, f"replica {self.name}", 900)

    def stop(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)


class Router:
    def __init__(self, model: str, replicas: list[Replica], policy: str, weights: str | None = None,
                 hold_s: float | None = None) -> None:
        self.port = free_ports(1)[0]
        argv = [sys.executable, "-m", "kvatlas", "route", model, "--port", str(self.port), "--policy", policy,
                "--health-interval-s", "0.5", "--stale-after-s", "10"] + (["--weights", weights] if weights else [])
        if hold_s is not None:
            argv += ["--hold-s", str(hold_s)]
        for r in replicas:
            argv += ["--replica", r.flag()]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        _ready_line(self.proc, "kvatlas route", 120)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return self.proc.returncode, err


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None


def histogram_quantile(text: str, name: str, q: float) -> float | None:
    """The upper bound of the bucket holding quantile q of a /metrics histogram."""
    from prometheus_client.parser import text_string_to_metric_families
    buckets = sorted((float(s.labels["le"]), s.value) for fam in text_string_to_metric_families(text)
                     for s in fam.samples if s.name == name + "_bucket")
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    return next(le for le, c in buckets if c >= q * total)


async def replay(router_url: str, requests, max_tokens: int) -> list[dict]:
    import aiohttp
    rows: list[dict] = []
    t0 = time.monotonic()
    base = requests[0].arrival_s
    timeout = aiohttp.ClientTimeout(total=900)

    async def one(i, req, session):
        await asyncio.sleep(max(0.0, t0 + (req.arrival_s - base) - time.monotonic()))
        ids = [int(t) for t in req.token_ids()]
        async with session.post(router_url + "/score", json={"prompt": ids}) as r:
            score = await r.json()
        sent = time.monotonic() - t0
        body = {"model": "m", "prompt": ids, "max_tokens": max(1, min(req.output_tokens, max_tokens))}
        async with session.post(router_url + "/v1/completions", json=body) as r:
            status, answer, replica = r.status, await r.json(), r.headers.get("X-Kvatlas-Replica")
        done = time.monotonic() - t0
        cand = {c["replica"]: c for c in score["candidates"]}.get(replica, {})
        usage = answer.get("usage") or {}
        rows.append({"i": i, "status": status, "replica": replica, "sent_s": sent, "latency_s": done - sent,
                     "prompt": len(ids), "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                     "scored_choice": score["choice"]["replica"], "predicted": cand.get("device_tokens"),
                     "expected": cand.get("expected_tokens"),
                     "main_group": min(cand.get("main_group_tokens", 0), len(ids) - 1) if cand else None,
                     "best_device": max(c["device_tokens"] for c in score["candidates"]),
                     "best_main_group": max(min(c.get("main_group_tokens", 0), len(ids) - 1) for c in score["candidates"]),
                     "error": None if status == 200 else answer})

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(i, req, session) for i, req in enumerate(requests)))
    return sorted(rows, key=lambda r: r["i"])


def summarize(policy: str, rows: list[dict], metrics_text: str, rc: int, err: str) -> dict:
    ok = [r for r in rows if r["status"] == 200 and r["cached"] is not None]
    prompt = sum(r["prompt"] for r in ok)
    cached = sum(r["cached"] for r in ok)
    exact = sum(r["predicted"] == r["cached"] for r in ok)
    expected_exact = sum(r["expected"] == r["cached"] for r in ok)
    main_exact = sum(r["main_group"] == r["cached"] for r in ok)
    over = [r["main_group"] - r["cached"] for r in ok if r["main_group"] is not None]
    m_exact = (metric(metrics_text, "kvatlas_route_prediction_error_tokens_bucket", le="0.0")
               - metric(metrics_text, "kvatlas_route_prediction_error_tokens_bucket", le="-1.0"))
    m_count = metric(metrics_text, "kvatlas_route_prediction_error_tokens_count")
    e_exact = (metric(metrics_text, "kvatlas_route_expected_error_tokens_bucket", le="0.0")
               - metric(metrics_text, "kvatlas_route_expected_error_tokens_bucket", le="-1.0"))
    e_count = metric(metrics_text, "kvatlas_route_expected_error_tokens_count")
    per = {}
    for r in ok:
        per.setdefault(r["replica"], 0)
        per[r["replica"]] += 1
    return {"policy": policy, "requests": len(rows), "answered_200": sum(r["status"] == 200 for r in rows),
            "prompt_tokens": prompt, "cached_tokens": cached, "hit_ratio": cached / prompt if prompt else 0.0,
            "score_exact": exact / len(ok) if ok else None,
            "metrics_exact": m_exact / m_count if m_count else None, "metrics_count": m_count,
            "score_expected_exact": expected_exact / len(ok) if ok else None,
            "metrics_expected_exact": e_exact / e_count if e_count else None,
            "main_group_exact": main_exact / len(ok) if ok else None,
            "main_group_overpredicted_tokens_mean": sum(over) / len(over) if over else None,
            "requests_by_replica": dict(sorted(per.items())),
            "routing_p50_s_bucket": histogram_quantile(metrics_text, "kvatlas_route_routing_seconds", 0.5),
            "routing_p99_s_bucket": histogram_quantile(metrics_text, "kvatlas_route_routing_seconds", 0.99),
            "latency_p50_s": pct([r["latency_s"] for r in ok], 0.5),
            "router_rc": rc, "router_traceback": "Traceback" in err,
            "retried": metric(metrics_text, "kvatlas_route_requests_total", reason="retry")}


def run_policy(model, replicas, policy, requests, max_tokens, weights=None, hold_s=None):
    import urllib.request
    for r in replicas:
        urllib.request.urlopen(urllib.request.Request(r.url + "/_reset", data=b"{}", method="POST"), timeout=120).read()
    router = Router(model, replicas, policy, weights, hold_s)
    try:
        deadline = time.monotonic() + 60
        while not all(x["up"] for x in get(router.url + "/state")["replicas"]):
            assert time.monotonic() < deadline, "replicas not up behind the router"
            time.sleep(0.2)
        rows = asyncio.run(replay(router.url, requests, max_tokens))
        text = get(router.url + "/metrics")
        state = get(router.url + "/state")
    finally:
        rc, err = router.stop()
    res = summarize(policy, rows, text, rc, err)
    res["stale_replicas_at_end"] = state["stale_replicas"]
    res["held"] = state["requests"].get("held", 0)      # requests held for a prefix in flight (--hold-s)
    return res, rows, state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--start", type=int, default=0, help="the first request of the subset (in arrival order)")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--memory", default="32GiB")
    ap.add_argument("--model", default="deepseek-v4-flash")
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--weights", help="the routers' --weights (e.g. in_flight=4096,running=1024,waiting=8192)")
    ap.add_argument("--hold-s", type=float, help="the routers' --hold-s (default: the router's own, 60)")
    ap.add_argument("--json")
    ap.add_argument("--rows", action="store_true", help="keep every request's row in the JSON")
    args = ap.parse_args()
    assert 1 <= args.requests <= 4000 and 1 <= args.replicas <= 8
    from kvatlas.driving.traces import read_trace
    requests, _ = read_trace(args.trace)
    requests = sorted(requests, key=lambda r: r.arrival_s)[args.start:args.start + args.requests]
    reps = [Replica(f"r{i}", args.memory, args.model) for i in range(args.replicas)]
    out = {"trace": os.path.basename(args.trace), "start": args.start, "requests": len(requests),
           "trace_span_s": requests[-1].arrival_s - requests[0].arrival_s, "replicas": args.replicas,
           "memory": args.memory, "policies": []}
    try:
        t = time.monotonic()
        for r in reps:
            r.spawn()
        for r in reps:
            r.ready()
        out["replica_start_s"] = time.monotonic() - t
        for policy in args.policies.split(","):
            res, rows, _ = run_policy(args.model, reps, policy, requests, args.max_tokens, args.weights, args.hold_s)
            res["weights"], res["hold_s"] = args.weights, args.hold_s
            print(json.dumps(res), flush=True)
            res["rows"] = rows if args.rows else None
            out["policies"].append(res)
    finally:
        for r in reps:
            r.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
