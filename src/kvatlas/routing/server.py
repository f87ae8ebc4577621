"""`kvatlas route`'s HTTP side (aiohttp): an OpenAI-compatible front for N vLLM replicas.

- `/v1/completions`, `/v1/chat/completions`: the request's token ids (taken as given, or from the
  model's tokenizer) are scored against every replica (and DP rank) by the chooser, the body goes
  unchanged to the best one (pinned to its rank with vLLM's `X-data-parallel-rank`), and the answer
  comes back as it arrives: a stream chunk by chunk, headers and status as the engine gave them.
  A replica that fails before its first byte (refused, reset, no answer within the first-byte
  timeout, a 5xx) is taken out and the request goes to the next best; once bytes have reached the
  client nothing is retried (the client would see them twice).
- `/v1/models` from a replica that is up; `/health` (200 while one replica is up, else 503);
  `POST /score` (the chooser's answer for a prompt, nothing sent); `/state` (versioned JSON, schema
  `kvatlas.route_state`); `/metrics` (Prometheus, `routing.metrics`).
- Errors the client caused are OpenAI's error JSON with a 4xx status; a failure of the replicas is a
  502/503 in the same shape. Nothing reaches the client as a traceback: an unexpected exception in a
  handler is logged and answered 500 in that shape.

The chooser (routing.choose) owns the events, the index and the policy; this module only asks it for
candidates, best first, and tells it what the engine then reported.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Sequence

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .metrics import RouteMetrics
from .replicas import HealthChecker, ReplicaState
from .tokenize import ClientError, PromptTokenizer

try:        # 2-3x faster than json on a prompt of token ids; what it refuses (NaN, 1e400) json.loads decides
    from msgspec import MsgspecError as _FastJSONError
    from msgspec.json import decode as _fast_json
except ImportError:         # msgspec comes with the routing extra; json alone gives the same answers
    _fast_json, _FastJSONError = json.loads, ValueError

log = logging.getLogger("kvatlas.route")

STATE_SCHEMA = "kvatlas.route_state"
STATE_SCHEMA_VERSION = 1
RETRY_STATUSES = frozenset({500, 502, 503, 504})
# hop-by-hop headers (RFC 9110 §7.6.1) and those aiohttp sets itself: never copied across
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "transfer-encoding", "upgrade", "content-length", "host", "content-encoding"})
USAGE_TAIL_BYTES = 16384   # a stream's usage is in its last chunk: keep this much of its end


class _Failed(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind, self.detail = kind, detail


class Router:
    def __init__(self, *, model: str, specs, chooser, tokenizer: PromptTokenizer, policy: str,
                 first_byte_timeout_s: float = 300.0, connect_timeout_s: float = 5.0,
                 health_interval_s: float = 2.0, health_timeout_s: float = 2.0, max_attempts: int | None = None,
                 hold_s: float = 0.0) -> None:
        self.model, self.policy = model, policy
        self.states = [ReplicaState(spec=s) for s in specs]
        self.by_name = {s.spec.name: s for s in self.states}
        self.chooser, self.tokenizer = chooser, tokenizer
        self.first_byte_timeout_s, self.connect_timeout_s = first_byte_timeout_s, connect_timeout_s
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self.max_attempts = max_attempts or len(self.states)
        self.hold_s = hold_s
        self.metrics = RouteMetrics(lambda: (self.states, self.chooser.event_stats()))
        self.started_s = time.time()
        self.session: aiohttp.ClientSession | None = None
        self.health: HealthChecker | None = None
        self._tasks: list[asyncio.Task] = []
        self.served = self.unserved = self.retried = 0

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self, app=None) -> None:
        conn = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(connector=conn, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar())
        self.health = HealthChecker(self.states, self.session, self.health_interval_s, self.health_timeout_s,
                                    on_change=self._health_changed)
        await self.chooser.start()
        self._tasks.append(asyncio.get_running_loop().create_task(self.health.run()))

    async def stop(self, app=None) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.chooser.stop()
        if self.session is not None:
            await self.session.close()

    def _health_changed(self, state: ReplicaState, up: bool) -> None:
        log.warning("replica %s %s", state.spec.name, "back" if up else f"taken out ({state.down_reason})")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[_errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health_endpoint)
        app.router.add_post("/score", self.score)
        app.router.add_get("/state", self.state_endpoint)
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app

    # --- the request path ------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, "/v1/completions", chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, "/v1/chat/completions", chat=True)

    async def _body(self, request: web.Request) -> tuple[bytes, dict]:
        raw = await request.read()
        try:
            try:
                body = _fast_json(raw)
            except _FastJSONError:
                body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise ClientError("the body is not JSON: send a JSON object (Content-Type: application/json)") from None
        if not isinstance(body, dict):
            raise ClientError("the body is a JSON " + type(body).__name__ + ": send a JSON object")
        return raw, body

    async def _token_ids(self, body: dict, chat: bool) -> Sequence[int]:
        if chat:
            if self.tokenizer.tok is None:
                self.tokenizer.chat_ids(body)   # raises the clear error
            return await asyncio.get_running_loop().run_in_executor(None, self.tokenizer.chat_ids, body)
        prompt = body.get("prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
            if self.tokenizer.tok is None:
                self.tokenizer.completion_ids(body)
            return await asyncio.get_running_loop().run_in_executor(None, self.tokenizer.completion_ids, body)
        return self.tokenizer.completion_ids(body)

    async def _route(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        raw, body = await self._body(request)
        t0 = time.perf_counter()
        ids = await self._token_ids(body, chat)
        prompt = self.chooser.prompt(ids)       # digested once: ranked, then kept as in flight where sent
        candidates = self.chooser.rank(prompt, self.states)
        self.metrics.routing.observe(time.perf_counter() - t0)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        first = None          # the first attempt's in-flight handle when it was held for a writer
        if self.hold_s and candidates[0].in_flight_tokens and self.by_name[candidates[0].replica].up:
            cand = candidates[0]
            first = self.chooser.sent(cand.replica, prompt)
            held_at = self.by_name[cand.replica]
            held_at.in_flight += 1     # its load while held: the requests routed meanwhile see it
            try:
                held_s = await self.chooser.hold(cand.replica, prompt, first, self.hold_s)
            except BaseException:      # the client went away while held
                self.chooser.done(first)
                raise
            finally:
                held_at.in_flight -= 1
            if held_s:
                self.metrics.held.labels(cand.replica).inc()
                self.metrics.hold.observe(held_s)
                candidates[0] = self.chooser.refreshed(cand, prompt, first)
        errors = []
        for attempt, cand in enumerate(candidates[:self.max_attempts]):
            state = self.by_name[cand.replica]
            reason = "retry" if attempt else ("last_resort" if not state.up else cand.reason)
            self.metrics.requests.labels(cand.replica, reason).inc()
            if attempt:
                self.retried += 1
            try:
                resp = await self._forward(request, state, cand, path, raw, headers, len(ids), prompt,
                                           first if attempt == 0 else None)
                self.served += 1
                return resp
            except _Failed as f:
                self.metrics.failures.labels(cand.replica, f.kind).inc()
                state.request_failed(f.kind, self.health_interval_s)
                log.warning("replica %s failed before its first byte (%s: %s)", cand.replica, f.kind, f.detail)
                errors.append(f"{cand.replica}: {f.kind} ({f.detail})")
        self.unserved += 1
        self.metrics.unserved.inc()
        raise ClientError("no replica could serve the request: " + ("; ".join(errors) or "none is configured"),
                          status=503, kind="service_unavailable")

    async def _forward(self, request, state: ReplicaState, cand, path, raw, headers, prompt_tokens, prompt,
                       handle=None):
        hdrs = dict(headers)
        if cand.dp_rank is not None and state.spec.dp_size > 1:
            hdrs["X-data-parallel-rank"] = str(cand.dp_rank)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
        state.in_flight += 1
        if handle is None:
            handle = self.chooser.sent(state.spec.name, prompt)
        try:
            try:
                ctx = self.session.post(state.spec.url + path, data=raw, headers=hdrs, timeout=timeout)
                upstream = await _first_byte(ctx.__aenter__(), self.first_byte_timeout_s)
            except asyncio.TimeoutError:
                raise _Failed("timeout", f"no answer within {self.first_byte_timeout_s:g} s") from None
            except aiohttp.ClientConnectorError as e:
                raise _Failed("refused", str(e.os_error or e)) from None
            except (aiohttp.ClientError, OSError) as e:
                raise _Failed("refused", f"{type(e).__name__}: {e}") from None
            try:
                if upstream.status in RETRY_STATUSES:
                    text = (await upstream.read())[:200].decode(errors="replace")
                    raise _Failed("http_5xx", f"HTTP {upstream.status}: {text}")
                return await self._relay(request, upstream, state, cand, prompt_tokens)
            finally:
                await ctx.__aexit__(None, None, None)
        finally:
            state.in_flight -= 1
            self.chooser.done(handle)

    async def _relay(self, request, upstream, state, cand, prompt_tokens) -> web.StreamResponse:
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
        out_headers["X-Kvatlas-Replica"] = state.spec.name
        streaming = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        if not streaming:
            try:
                data = await upstream.read()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                raise _Failed("broken_stream", f"{type(e).__name__}: {e}") from None
            if upstream.status == 200:
                state.answered()
                # after the answer is on its way: the accounting is no part of the client's wait
                asyncio.get_running_loop().call_soon(self._usage, data, state, cand)
            return web.Response(body=data, status=upstream.status, headers=out_headers)
        resp = web.StreamResponse(status=upstream.status, headers=out_headers)
        tail = b""
        first = True
        try:
            async for chunk in upstream.content.iter_any():
                if first:
                    await resp.prepare(request)
                    first = False
                await resp.write(chunk)
                tail = (tail + chunk)[-USAGE_TAIL_BYTES:]
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            if first:
                raise _Failed("broken_stream", f"{type(e).__name__}: {e}") from None
            self.metrics.failures.labels(state.spec.name, "broken_stream").inc()
            state.request_failed("broken_stream", self.health_interval_s)
            log.warning("replica %s broke a stream after its first byte: %s", state.spec.name, e)
            return resp   # the client sees the stream end early; its bytes cannot be taken back
        if first:
            await resp.prepare(request)
        await resp.write_eof()
        state.answered()
        self._usage(_last_usage_chunk(tail), state, cand)
        return resp

    def _usage(self, data: bytes | None, state, cand) -> None:
        if not data:
            return
        try:
            usage = json.loads(data).get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            prompt = usage.get("prompt_tokens")
        except (ValueError, AttributeError, UnicodeDecodeError):
            return
        if isinstance(cached, int) and isinstance(prompt, int):
            expected = None if cand.predicted_tokens is None else cand.predicted_tokens + cand.in_flight_tokens
            self.metrics.observe_usage(state.spec.name, cand.predicted_tokens, cached, prompt, expected)
            self.chooser.answered(state.spec.name, cand.dp_rank, prompt, cached)

    # --- the other endpoints ---------------------------------------------------------------------
    async def models(self, request):
        for state in sorted(self.states, key=lambda s: not s.up):
            try:
                timeout = aiohttp.ClientTimeout(total=self.health_timeout_s)
                async with self.session.get(state.spec.url + "/v1/models", timeout=timeout) as r:
                    if r.status == 200:
                        return web.Response(body=await r.read(), content_type="application/json")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                continue
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model",
                                                              "owned_by": "kvatlas-route", "created": int(self.started_s)}]})

    async def health_endpoint(self, request):
        up = [s.spec.name for s in self.states if s.up]
        return web.json_response({"status": "ok" if up else "no replica up", "replicas_up": up},
                                 status=200 if up else 503)

    async def score(self, request):
        _, body = await self._body(request)
        chat = "messages" in body
        if not chat and "prompt" not in body:
            raise ClientError("give prompt (token ids or text) or messages", param="prompt")
        ids = await self._token_ids(body, chat)
        t0 = time.perf_counter()
        doc = self.chooser.score(ids, self.states)
        doc["routing_seconds"] = time.perf_counter() - t0
        return web.json_response(doc)

    def state(self) -> dict:
        now = time.monotonic()
        ranks = self.chooser.rank_state()
        replicas = [{"name": s.spec.name, "url": s.spec.url, "up": s.up, "down_reason": s.down_reason or None,
                     "down_for_s": None if s.down_since_s is None else now - s.down_since_s,
                     "in_flight": s.in_flight, "running": s.running, "waiting": s.waiting,
                     "failures": s.failures, "recoveries": s.recoveries,
                     "ranks": [{"dp_rank": r.dp_rank, "events_endpoint": r.events_endpoint,
                                "replay_endpoint": r.replay_endpoint,
                                **ranks.get((s.spec.name, r.dp_rank), {"events": None, "index": None})}
                               for r in s.spec.ranks]}
                    for s in self.states]
        stale = sorted({name for (name, _), r in ranks.items() if r["events"]["stale"]})
        from .. import __version__
        return {"schema": STATE_SCHEMA, "schema_version": STATE_SCHEMA_VERSION, "time_unix_s": time.time(),
                "version": __version__, "model": self.model,
                "policy": self.policy, "uptime_s": time.time() - self.started_s,
                "requests": {"served": self.served, "retried": self.retried, "unserved": self.unserved,
                             "held": self.chooser.held_total, "holding": len(self.chooser.held)},
                "stale_replicas": stale, "replicas": replicas, **self.chooser.state()}

    async def state_endpoint(self, request):
        return web.json_response(self.state())

    async def metrics_endpoint(self, request):
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


if hasattr(asyncio, "timeout"):          # Python 3.11+: a deadline on this task, no task of its own
    async def _first_byte(coro, seconds: float):
        async with asyncio.timeout(seconds):
            return await coro
else:                                    # 3.10: wait_for runs the coroutine as a task of its own
    async def _first_byte(coro, seconds: float):
        return await asyncio.wait_for(coro, seconds)


def _last_usage_chunk(tail: bytes) -> bytes | None:
    """The JSON of the last SSE `data:` line that carries a usage object."""
    for line in reversed(tail.split(b"\n")):
        line = line.strip()
        if line.startswith(b"data:") and b'"usage"' in line:
            return line[5:].strip()
    return None


@web.middleware
async def _errors(request, handler):
    try:
        return await handler(request)
    except ClientError as e:
        return web.json_response(e.to_json(), status=e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        return web.json_response({"error": {"message": f"{request.method} {request.path}: {e.reason}", "type": kind,
                                            "param": None, "code": e.status}}, status=e.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:   # a bug: logged with its traceback here, never sent to the client
        log.exception("kvatlas route: unexpected error on %s %s", request.method, request.path)
        return web.json_response({"error": {"message": "kvatlas route hit an internal error (logged); "
                                            "report it on the kvatlas issue tracker", "type": "server_error",
                                            "param": None, "code": 500}}, status=500)
