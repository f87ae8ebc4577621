"""vLLM's offline engine core (`offline.py`) as one replica behind a router: the engine's own KV events
switched on, published by vLLM's own ZMQ publisher (or captured in process, as the bytes that
publisher would send), and the engine's own answers a router is measured against.

- `build_publishing_engine(model, memory, endpoint=..., replay_endpoint=...)`: `build_engine` with
  `KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", ...)`; with `capture=True` the
  scheduler's publisher is replaced by `CapturePublisher`, which keeps each batch msgpack-encoded by
  vLLM's own encoder (what goes on the wire) for a test to feed an index step by step.
- `engine_hit(engine, token_ids)`: what vLLM's KV cache manager would resume a request of these
  tokens from now: `find_longest_cache_hit` over the request's block hashes up to n - 1 tokens,
  as `KVCacheManager.get_computed_blocks` calls it (a lookup: nothing is touched or allocated).
- `group_metadata(engine)`: the groups as vLLM 0.34's `EngineCore.get_kv_cache_group_metadata()`
  lists them (`[{group_idx, kind, block_size, sliding_window}]`), read from the scheduler's config.
- `ReplicaServer(model, memory, endpoint, replay_endpoint, options)`: one replica of the routing
  harness (bench/routing_cluster.py) answering its commands; `serve_replica(conn, ...)` runs one
  in a process of its own, commands over a pipe.
"""

from __future__ import annotations

from . import offline as kv

__all__ = ["CapturePublisher", "ReplicaServer", "build_publishing_engine", "engine_hit", "evict_cached",
           "flush_events", "group_metadata", "serve_replica"]


class CapturePublisher:
    """Stands where vLLM's ZMQ publisher stands; keeps the encoded batches instead of sending them."""

    def __init__(self) -> None:
        import msgspec
        self._encoder = msgspec.msgpack.Encoder()
        self.payloads: list[bytes] = []

    def publish(self, batch) -> None:
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = 0
        self.payloads.append(self._encoder.encode(batch))

    def take(self) -> list[bytes]:
        out, self.payloads = self.payloads, []
        return out

    def shutdown(self) -> None:
        pass

    def get_publisher_config(self):
        return None


def build_publishing_engine(model, memory, *, endpoint: str | None = None, replay_endpoint: str | None = None,
                            buffer_steps: int = 10_000, capture: bool = False, options=None, **kwargs):
    """The offline engine with its KV events on: published on `endpoint` (bind, e.g.
    "tcp://127.0.0.1:5557"), or captured (`capture=True`; `engine.core.scheduler.kv_event_publisher`
    is then a `CapturePublisher`)."""
    from vllm.config import KVEventsConfig
    from vllm.v1.engine.core import EngineCore
    from ...errors import ConfigError
    from ...units import parse_bytes
    if capture == (endpoint is not None):
        raise ConfigError("endpoint", "give either an endpoint to publish on or capture=True", "not both, not neither")
    opts = kv.EngineOptions.of(options, kwargs)
    budget = parse_bytes(memory)
    config = kv.vllm_config(model, opts)
    config.kv_events_config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="null" if capture else "zmq",
        endpoint=endpoint or "tcp://*:5557", replay_endpoint=replay_endpoint, buffer_steps=buffer_steps)
    executor = type("OfflineExecutor", (kv._executor_class(),), {"budget_bytes": budget})
    core = EngineCore(config, executor, log_stats=opts.log_stats)
    if capture:
        core.scheduler.kv_event_publisher = CapturePublisher()
    return kv.OfflineEngine(core=core, options=opts, budget_bytes=budget)


def engine_hit(engine, token_ids) -> int:
    """Tokens vLLM's own KV cache manager would resume `token_ids` from, now."""
    request = engine.make_request("kvatlas-oracle", list(token_ids), max_tokens=1)
    manager = engine.kv_cache_manager
    if not manager.prefix_cache_lookup_enabled(request):
        return 0
    _, hit, _ = manager.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
    return hit


def group_metadata(engine) -> list[dict]:
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind
    out = []
    for i, group in enumerate(engine.kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        out.append({"group_idx": i, "kind": get_kv_cache_spec_kind(spec).value, "block_size": spec.block_size,
                    "sliding_window": getattr(spec, "sliding_window", None)})
    return out


def flush_events(engine) -> None:
    """Publish what the block pool queued outside a step (an `evict_blocks`, a cache reset) as the
    scheduler does at the end of a step: one batch through the engine's publisher."""
    import time
    from vllm.distributed.kv_events import KVEventBatch
    events = engine.kv_cache_manager.take_events()
    if events:
        engine.core.scheduler.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))


def evict_cached(engine, token_ids, group: int, end_tokens: int) -> int:
    """Evict from vLLM's prefix cache the block of `group` whose prefix is token_ids[:end_tokens]
    (through `KVCacheManager.evict_blocks`, the path a KV connector's failed load takes); returns
    how many copies went. Tests use it to make one group lose one block on purpose."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
    request = engine.make_request("kvatlas-evict", list(token_ids), max_tokens=1)
    unit = engine.block_pool.hash_block_size
    key = make_block_hash_with_group_id(request.block_hashes[end_tokens // unit - 1], group)
    ids = set()
    while (block := engine.block_pool.cached_block_hash_to_block.get_one_block(key)) is not None \
            and block.block_id not in ids:
        ids.add(block.block_id)
        engine.kv_cache_manager.evict_blocks({block.block_id})
    return len(ids)


# ---- a replica's process, for the routing harness ------------------------------------------------

class _Counting:
    """Counts the batches the scheduler hands its publisher (the publisher numbers them 0, 1, ...
    in that order), so the harness knows which seq the router must have seen."""

    def __init__(self, inner) -> None:
        self.inner, self.published = inner, 0

    def publish(self, batch) -> None:
        self.published += 1
        self.inner.publish(batch)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class ReplicaServer:
    """One replica for the routing harness: the engine (events published on `endpoint`) and the
    harness's commands, `handle(cmd, *args)`: ("add", id, token_ids, max_tokens), ("step",) → what
    the step did, ("hit", token_ids) → `engine_hit`, ("reset",) → empty the cache, ("stop",).
    In the harness's process, or in a process of its own (`serve_replica`)."""

    def __init__(self, model, memory, endpoint: str, replay_endpoint: str | None, options: dict) -> None:
        self.engine = build_publishing_engine(model, memory, endpoint=endpoint, replay_endpoint=replay_endpoint,
                                              **options)
        self.scheduler = self.engine.core.scheduler
        self.scheduler.kv_event_publisher = _Counting(self.scheduler.kv_event_publisher)
        self.metadata = group_metadata(self.engine)
        self.seen_outputs = 0

    def handle(self, cmd: str, *args):
        eng, sched = self.engine, self.scheduler
        if cmd == "add":
            rid, tokens, max_tokens = args
            eng.add_request(rid, [int(t) for t in tokens], max_tokens=max_tokens)
            return None
        if cmd == "step":
            out = _step(eng, self.seen_outputs)
            self.seen_outputs = len(eng.outputs)
            return out
        if cmd == "hit":
            return engine_hit(eng, args[0])
        if cmd == "reset":
            eng.abort(list(sched.requests))
            while eng.has_requests():
                eng.step()
            ok = eng.core.reset_prefix_cache()
            flush_events(eng)
            self.seen_outputs = len(eng.outputs)
            return ok, sched.kv_event_publisher.published
        if cmd == "stop":
            sched.kv_event_publisher.shutdown()
            return None
        raise ValueError(f"unknown replica command {cmd!r}")


def serve_replica(conn, model, memory, endpoint: str, replay_endpoint: str | None, options: dict) -> None:
    """A replica's process body: a `ReplicaServer` answering the harness's calls over `conn`, one
    at a time, until ("stop",)."""
    server = ReplicaServer(model, memory, endpoint, replay_endpoint, options)
    conn.send(("ready", server.metadata))
    while True:
        cmd, *args = conn.recv()
        conn.send(server.handle(cmd, *args))
        if cmd == "stop":
            return


def counted_step(eng) -> tuple:
    """One engine step (when it has requests): whether it ran, and the prompt and decode tokens it
    computed, read from each request's progress across the step."""
    sched = eng.scheduler
    before = {rid: (r.num_computed_tokens, r.num_prompt_tokens) for rid, r in sched.requests.items()}
    ran = eng.step() if eng.has_requests() else False
    prefill = decode = 0
    for rid, (done, prompt) in before.items():
        r = sched.requests.get(rid)
        delta = (r.num_computed_tokens if r is not None else max(prompt, done + 1)) - done
        fill = max(0, min(prompt, done + delta) - done)
        prefill, decode = prefill + fill, decode + max(0, delta - fill)
    return ran, prefill, decode


def _step(eng, seen_outputs: int) -> dict:
    sched = eng.scheduler
    ran, prefill, decode = counted_step(eng)
    cached, finished = {}, []
    for outs in eng.outputs[seen_outputs:]:
        for o in outs.outputs:
            if o.prefill_stats is not None:
                cached[o.request_id] = o.prefill_stats.num_local_cached_tokens
            if o.finish_reason is not None:
                finished.append(o.request_id)
    return {"ran": ran, "prefill_tokens": prefill, "decode_tokens": decode, "cached": cached,
            "finished": finished, "running": len(sched.running), "waiting": len(sched.waiting),
            "published": sched.kv_event_publisher.published}
