"""One vLLM replica for `kvatlas route`'s end-to-end run: vLLM's real engine core (its scheduler,
hybrid KV cache manager and ZMQ KV-event publisher with a replay socket; `kvatlas.integrations.
vllm.replica.build_publishing_engine`, the offline executor: no model runs on these CPUs) behind a
minimal OpenAI-style HTTP server (aiohttp) on loopback.

Why not vLLM's own OpenAI API server: it drives the engine through `AsyncLLM`, whose engine-core
process builds vLLM's platform worker and model runner (and loads the compiled `vllm._C`); none of
that loads on a CPU-only host with vLLM's CUDA wheel, and the offline executor stands in for the
worker only inside one process. So this server does the API server's part for the fields a router
reads, and nothing else:

- `POST /v1/completions` with `prompt` as token ids (one prompt), `max_tokens`: the request enters
  the engine core (`EngineCore.add_request`) and is answered when it finishes, with vLLM's usage:
  `prompt_tokens`, `completion_tokens` and `prompt_tokens_details.cached_tokens` = the engine's own
  `num_local_cached_tokens` for the request (what vLLM's server reports).
- `GET /health`, `GET /v1/models`, `GET /metrics` (`vllm:num_requests_running`, `_waiting`).
- `POST /_reset`: abort everything, `reset_prefix_cache` (vLLM publishes `AllBlocksCleared`).
- `GET /_info`: requests served, engine steps, events published.

Its engine's publisher is given `tcp://127.0.0.1:EVENTS`: vLLM connects to a named host (it binds
only a wildcard one, which would listen beyond loopback), so the router binds there (`--replica
…,bind`). The replay socket is the engine's own, bound on loopback.

The engine steps on a thread of its own; with `--pass-time` each step then takes the time kvatlas's
default time model gives its computed tokens (20 ms + 40 µs per prefill token + 100 µs per decode
token; hit tokens cost nothing), so replicas are busy as long as a GPU would be and the load the
router balances is real. Without it a step takes what the scheduler takes.

    python tests/route_vllm_replica.py --http-port P --events-port E --replay-port R
        [--model deepseek-v4-flash] [--memory 32GiB] [--pass-time]

prints one JSON line `{"http": URL, "events": ENDPOINT, "replay": ENDPOINT, "pid": PID}` when ready.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import sys
import threading
import time

from aiohttp import web

SERVING = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "async_scheduling": False,
           "max_model_len": 196_608}


class EngineThread:
    def __init__(self, engine, loop: asyncio.AbstractEventLoop, pass_time: bool) -> None:
        from kvatlas.driving.timemodel import default_time_model
        self.eng, self.loop = engine, loop
        self.tm = default_time_model() if pass_time else None
        self.inbox: queue.Queue = queue.Queue()
        self.waiters: dict[str, tuple[asyncio.Future, int]] = {}
        self.cached: dict[str, int] = {}
        self.outputs: dict[str, int] = {}
        self.seen = 0
        self.steps = 0
        self.served = 0
        self.running = self.waiting = 0
        threading.Thread(target=self._run, daemon=True, name="engine").start()

    def submit(self, rid: str, tokens: list[int], max_tokens: int) -> asyncio.Future:
        fut = self.loop.create_future()
        self.inbox.put(("add", rid, tokens, max_tokens, fut))
        return fut

    def call(self, fn) -> asyncio.Future:
        fut = self.loop.create_future()
        self.inbox.put(("call", fn, fut))
        return fut

    def _resolve(self, fut, value) -> None:
        self.loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(value))

    def _run(self) -> None:
        eng = self.eng
        while True:
            try:
                msg = self.inbox.get(timeout=0.02) if not eng.has_requests() else self.inbox.get_nowait()
            except queue.Empty:
                msg = None
            while msg is not None:
                if msg[0] == "add":
                    _, rid, tokens, max_tokens, fut = msg
                    try:
                        eng.add_request(rid, tokens, max_tokens=max_tokens)
                        self.waiters[rid] = (fut, len(tokens))
                    except Exception as e:   # the engine refused it (too long, …): answered as vLLM would, 400
                        self._resolve(fut, e)
                else:
                    _, fn, fut = msg
                    self._resolve(fut, fn(eng))
                try:
                    msg = self.inbox.get_nowait()
                except queue.Empty:
                    msg = None
            if eng.has_requests():
                self._step()

    def _step(self) -> None:
        from kvatlas.integrations.vllm.replica import counted_step
        eng = self.eng
        sched = eng.scheduler
        _, prefill, decode = counted_step(eng)   # (called only while the engine has requests)
        self.steps += 1
        for outs in eng.outputs[self.seen:]:
            for o in outs.outputs:
                if o.prefill_stats is not None:
                    self.cached[o.request_id] = o.prefill_stats.num_local_cached_tokens
                self.outputs[o.request_id] = self.outputs.get(o.request_id, 0) + len(o.new_token_ids)
                if o.finish_reason is not None and o.request_id in self.waiters:
                    fut, prompt = self.waiters.pop(o.request_id)
                    self.served += 1
                    self._resolve(fut, {"prompt_tokens": prompt, "cached_tokens": self.cached.pop(o.request_id, 0),
                                        "completion_tokens": self.outputs.pop(o.request_id, 0)})
        self.seen = len(eng.outputs)
        if len(eng.outputs) > 1024:   # keep memory flat over a long run
            del eng.outputs[:self.seen]
            self.seen = 0
        self.running, self.waiting = len(sched.running), len(sched.waiting)
        if self.tm is not None:
            time.sleep(self.tm.pass_time_s(prefill, decode))


def error(status: int, message: str, param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                        "code": status}}, status=status)


def make_app(args, et: EngineThread) -> web.Application:
    counter = iter(range(1 << 62))

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) and len(prompt) == 1:
            prompt = prompt[0]
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            return error(400, "this replica takes one prompt of token ids", "prompt")
        if body.get("stream"):
            return error(400, "this replica does not stream", "stream")
        rid = f"cmpl-{os.getpid()}-{next(counter)}"
        res = await et.submit(rid, prompt, int(body.get("max_tokens") or 16))
        if isinstance(res, Exception):
            return error(400, f"{type(res).__name__}: {res}", "prompt")
        usage = {"prompt_tokens": res["prompt_tokens"], "completion_tokens": res["completion_tokens"],
                 "total_tokens": res["prompt_tokens"] + res["completion_tokens"],
                 "prompt_tokens_details": {"cached_tokens": res["cached_tokens"]}}
        return web.json_response({"id": rid, "object": "text_completion", "created": int(time.time()),
                                  "model": args.model, "usage": usage,
                                  "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})

    async def metrics(request):
        return web.Response(text=f'vllm:num_requests_running{{engine="0"}} {et.running}\n'
                                 f'vllm:num_requests_waiting{{engine="0"}} {et.waiting}\n')

    async def reset(request):
        def do(eng):
            from kvatlas.integrations.vllm.replica import flush_events
            eng.abort(list(eng.scheduler.requests))
            while eng.has_requests():
                eng.step()
            ok = eng.core.reset_prefix_cache()
            flush_events(eng)
            return ok
        return web.json_response({"reset": await et.call(do)})

    async def info(request):
        pub = et.eng.scheduler.kv_event_publisher
        return web.json_response({"served": et.served, "steps": et.steps, "running": et.running,
                                  "waiting": et.waiting, "publisher": type(pub).__name__})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", lambda r: web.Response(text=""))
    app.router.add_get("/v1/models", lambda r: web.json_response(
        {"object": "list", "data": [{"id": args.model, "object": "model", "owned_by": "vllm"}]}))
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/_reset", reset)
    app.router.add_get("/_info", info)
    return app


async def main(args) -> None:
    from kvatlas.integrations.vllm.replica import build_publishing_engine
    eng = build_publishing_engine(args.model, args.memory, endpoint=f"tcp://127.0.0.1:{args.events_port}",
                                  replay_endpoint=f"tcp://127.0.0.1:{args.replay_port}", **SERVING)
    et = EngineThread(eng, asyncio.get_running_loop(), args.pass_time)
    runner = web.AppRunner(make_app(args, et), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.http_port).start()
    print(json.dumps({"http": f"http://127.0.0.1:{args.http_port}", "events": f"tcp://127.0.0.1:{args.events_port}",
                      "replay": f"tcp://127.0.0.1:{args.replay_port}", "pid": os.getpid()}), flush=True)
    await asyncio.Event().wait()


def parse(argv=None):
    p = argparse.ArgumentParser(description="vLLM's engine core behind a minimal OpenAI-style server")
    p.add_argument("--http-port", type=int, required=True)
    p.add_argument("--events-port", type=int, required=True)
    p.add_argument("--replay-port", type=int, required=True)
    p.add_argument("--model", default="deepseek-v4-flash")
    p.add_argument("--memory", default="32GiB")
    p.add_argument("--pass-time", action="store_true")
    return p.parse_args(argv)


if __name__ == "__main__":
    try:
        asyncio.run(main(parse()))
    except KeyboardInterrupt:
        sys.exit(0)
