"""`kvatlas route`'s /metrics: prometheus_client with a private registry (several routers in one
process, as the tests run them, never collide).

Counted as requests go: requests by replica and reason, failures by replica and kind, requests no
replica could serve, predicted and engine-reported cached tokens (vLLM's
`usage.prompt_tokens_details.cached_tokens`) and their difference as a histogram — the prediction
both as resident at routing time and as expected once the prefixes in flight there are computed —,
routing time.
Read at each scrape (a Collector over the router's live objects): replicas up, requests in flight,
and per replica and DP rank the event stream's lag, batches, gaps, replays, malformed batches and
whether it is stale.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# engine-reported − predicted, in tokens: 0 is an exact prediction; DeepSeek-V4 hits move in 256s
ERROR_BUCKETS = (-65536, -16384, -4096, -1024, -256, -1, 0, 256, 1024, 4096, 16384, 65536)
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
ROUTING_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0)

# the reasons a request went where it went
REASONS = ("prefix", "load", "policy", "retry", "last_resort")
# how a request to a replica failed
FAILURES = ("refused", "timeout", "http_5xx", "broken_stream")

HELP = {
    "kvatlas_route_requests": "Requests sent to a replica, by the reason it was chosen",
    "kvatlas_route_failures": "Requests to a replica that failed, by how",
    "kvatlas_route_unserved_requests": "Requests no replica could serve (answered with an error)",
    "kvatlas_route_predicted_cached_tokens": "Prompt tokens the router predicted the chosen replica holds",
    "kvatlas_route_engine_cached_tokens": "Prompt tokens the engine reported cached (usage.prompt_tokens_details.cached_tokens)",
    "kvatlas_route_prompt_tokens": "Prompt tokens of requests whose engine reported its cached tokens",
    "kvatlas_route_prediction_error_tokens": "Engine-reported minus predicted cached tokens, per request",
    "kvatlas_route_expected_cached_tokens": "Prompt tokens the router expected the chosen replica to resume: "
                                            "resident at routing time plus prefixes in flight there",
    "kvatlas_route_expected_error_tokens": "Engine-reported minus expected (incl. prefixes in flight) cached tokens, per request",
    "kvatlas_route_routing_seconds": "Time to choose a replica: tokenizing, predicting and scoring",
    "kvatlas_route_held_requests": "Requests held before being sent, until the replica computed a prefix in flight "
                                   "there that they share (or its writer ended, or --hold-s passed)",
    "kvatlas_route_hold_seconds": "How long a held request waited before being sent",
    "kvatlas_route_replica_up": "1 while the replica takes requests, 0 while it is taken out",
    "kvatlas_route_in_flight_requests": "Requests the router has open to the replica",
    "kvatlas_route_event_lag_seconds": "Age of the newest event batch the router applied, per replica and DP rank",
    "kvatlas_route_event_batches": "Event batches applied, per replica and DP rank",
    "kvatlas_route_event_gaps": "Sequence gaps seen in a replica's event stream",
    "kvatlas_route_event_replays": "Replays asked of a replica's replay socket",
    "kvatlas_route_event_malformed": "Event batches that could not be decoded (dropped)",
    "kvatlas_route_event_stale": "1 while a replica rank's events are stale: it is scored from load alone",
    "kvatlas_route_stale_replicas": "Replicas with a stale event stream on any rank",
}


class RouteMetrics:
    def __init__(self, live) -> None:
        """`live()` → (replica states, per-rank event stats: list of dicts with replica, dp_rank,
        lag_s, batches, gaps, replays, malformed, stale)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvatlas_route_requests", HELP["kvatlas_route_requests"], ["replica", "reason"], registry=r)
        self.failures = Counter("kvatlas_route_failures", HELP["kvatlas_route_failures"], ["replica", "kind"], registry=r)
        self.unserved = Counter("kvatlas_route_unserved_requests", HELP["kvatlas_route_unserved_requests"], registry=r)
        self.predicted = Counter("kvatlas_route_predicted_cached_tokens", HELP["kvatlas_route_predicted_cached_tokens"],
                                 ["replica"], registry=r)
        self.engine = Counter("kvatlas_route_engine_cached_tokens", HELP["kvatlas_route_engine_cached_tokens"],
                              ["replica"], registry=r)
        self.prompt = Counter("kvatlas_route_prompt_tokens", HELP["kvatlas_route_prompt_tokens"], ["replica"], registry=r)
        self.error = Histogram("kvatlas_route_prediction_error_tokens", HELP["kvatlas_route_prediction_error_tokens"],
                               ["replica"], buckets=ERROR_BUCKETS, registry=r)
        self.expected = Counter("kvatlas_route_expected_cached_tokens", HELP["kvatlas_route_expected_cached_tokens"],
                                ["replica"], registry=r)
        self.expected_error = Histogram("kvatlas_route_expected_error_tokens", HELP["kvatlas_route_expected_error_tokens"],
                                        ["replica"], buckets=ERROR_BUCKETS, registry=r)
        self.routing = Histogram("kvatlas_route_routing_seconds", HELP["kvatlas_route_routing_seconds"],
                                 buckets=ROUTING_BUCKETS, registry=r)
        self.held = Counter("kvatlas_route_held_requests", HELP["kvatlas_route_held_requests"], ["replica"], registry=r)
        self.hold = Histogram("kvatlas_route_hold_seconds", HELP["kvatlas_route_hold_seconds"], buckets=HOLD_BUCKETS,
                              registry=r)
        r.register(_Live(live))

    def observe_usage(self, replica: str, predicted: int | None, cached: int, prompt: int,
                      expected: int | None = None) -> None:
        """One answer's engine-reported cached tokens against the prediction made for it: resident
        at routing time (`predicted`) and including the prefixes in flight there (`expected`)."""
        self.engine.labels(replica).inc(cached)
        self.prompt.labels(replica).inc(prompt)
        if predicted is not None:
            self.predicted.labels(replica).inc(predicted)
            self.error.labels(replica).observe(cached - predicted)
        if expected is not None:
            self.expected.labels(replica).inc(expected)
            self.expected_error.labels(replica).observe(cached - expected)


class _Live:
    """Gauges and stream counters read from the router at scrape time."""

    def __init__(self, live) -> None:
        self.live = live

    def describe(self):
        return []

    def collect(self):
        states, ranks = self.live()
        up = GaugeMetricFamily("kvatlas_route_replica_up", HELP["kvatlas_route_replica_up"], labels=["replica", "reason"])
        fl = GaugeMetricFamily("kvatlas_route_in_flight_requests", HELP["kvatlas_route_in_flight_requests"], labels=["replica"])
        for s in states:
            up.add_metric([s.spec.name, s.down_reason], 1.0 if s.up else 0.0)
            fl.add_metric([s.spec.name], s.in_flight)
        yield up
        yield fl
        labels = ["replica", "dp_rank"]
        lag = GaugeMetricFamily("kvatlas_route_event_lag_seconds", HELP["kvatlas_route_event_lag_seconds"], labels=labels)
        stale = GaugeMetricFamily("kvatlas_route_event_stale", HELP["kvatlas_route_event_stale"], labels=labels)
        counters = {k: CounterMetricFamily(f"kvatlas_route_event_{k}", HELP[f"kvatlas_route_event_{k}"], labels=labels)
                    for k in ("batches", "gaps", "replays", "malformed")}
        stale_replicas = set()
        for st in ranks:
            key = [st["replica"], str(st["dp_rank"])]
            if st["lag_s"] is not None:
                lag.add_metric(key, st["lag_s"])
            stale.add_metric(key, 1.0 if st["stale"] else 0.0)
            if st["stale"]:
                stale_replicas.add(st["replica"])
            for k, fam in counters.items():
                fam.add_metric(key, st[k])
        yield lag
        yield stale
        yield from counters.values()
        n = GaugeMetricFamily("kvatlas_route_stale_replicas", HELP["kvatlas_route_stale_replicas"])
        n.add_metric([], len(stale_replicas))
        yield n
