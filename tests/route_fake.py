"""A minimal stand-in for one vLLM replica, for the router's tests and bench: vLLM's OpenAI API
server answers over HTTP and its engine publishes KV events over ZMQ, and neither runs on these CPUs
without the engine. This one does both, for DeepSeek-V4's four KV cache groups, on loopback:

- HTTP (aiohttp): `/v1/completions` and `/v1/chat/completions` (token ids or text; streaming as SSE
  with `stream_options.include_usage`), `/v1/models`, `/health`, and `/metrics` with vLLM's
  `vllm:num_requests_running` / `vllm:num_requests_waiting`. Every answer reports
  `usage.prompt_tokens_details.cached_tokens`: the hit its own cache gives, by DeepSeek-V4's rule.
- Its cache: a prefix tree of 256-token boundaries (LRU over leaves, `--capacity-blocks` group-0
  blocks). A boundary b holds group 0's block ending at b and each sliding group's tail ending at b
  (SWA: 2 blocks of 64; C4 state: 2 of 4; C128 state: 16 of 8), as vLLM keeps them under its
  retention rule. The hit of a prompt of L tokens is the largest resident boundary b ≤ L − 1 whose
  whole chain is resident.
- Events (vLLM's wire, `vllm/distributed/kv_events.py`): ZMQ PUB `(topic, seq 8 bytes big-endian,
  msgpack [ts, events, dp_rank])`, seq from 0; `BlockStored` / `BlockRemoved` per group with
  `group_idx`, `block_size`, `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`, 64-bit integer
  hashes chained per 4 tokens (a block publishes the hash of its last 4 tokens, so blocks of different
  groups ending at one token share a hash); a ROUTER replay socket that answers a start seq with every
  buffered batch from it, then seq −1.
- Faults on demand, `POST /_fake/faults` (JSON): `event_delay_s` (hold each batch that long, from
  the wire and the replay buffer alike),
  `drop_batches` (skip publishing the next N batches; they stay in the replay buffer, so a subscriber
  sees a gap), `malformed` (publish the next N batches as bytes that are not msgpack, with a seq),
  `events_off` (publish nothing), `first_byte_delay_s` (answer that late), `fail_status` (answer the
  next requests with that HTTP status). `POST /_fake/clear` empties the cache and publishes
  `AllBlocksCleared`.

    python tests/route_fake.py [--http-port 0] [--events-port 0] [--replay-port 0] [--dp-rank 0]
        [--tokenizer DIR] [--capacity-blocks 4096] [--stream-chunks 4] [--chunk-delay-s 0]

prints one JSON line `{"http": URL, "events": ENDPOINT, "replay": ENDPOINT, "pid": PID}` when ready.
Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import json
import os
import struct
import sys
import threading
import time

import msgpack
import zmq
import zmq.asyncio
from aiohttp import web

BOUNDARY_TOKENS = 256
HASH_UNIT_TOKENS = 4
# (group_idx, kind, block tokens, sliding window tokens or None, tail blocks kept at a boundary)
GROUPS = ((0, "mla_attention", 256, None, 1),
          (1, "sliding_window_mla", 64, 128, 2),
          (2, "sliding_window", 4, 8, 2),
          (3, "sliding_window", 8, 128, 16))


def chain_hashes(tokens: list[int]) -> list[int]:
    """hashes[k] = the 64-bit digest of tokens[:4k] (hashes[0] = the root seed)."""
    out = [0]
    h = b"\0" * 8
    for i in range(0, len(tokens) - len(tokens) % HASH_UNIT_TOKENS, HASH_UNIT_TOKENS):
        h = hashlib.blake2b(h + struct.pack("<4q", *tokens[i:i + 4]), digest_size=8).digest()
        out.append(int.from_bytes(h, "big"))
    return out


def hit_tokens(resident: dict, hashes: list[int], num_tokens: int) -> int:
    """DeepSeek-V4's hit: the largest boundary b ≤ num_tokens − 1 with every boundary up to b resident."""
    hit = 0
    for b in range(BOUNDARY_TOKENS, num_tokens, BOUNDARY_TOKENS):
        if hashes[b // HASH_UNIT_TOKENS] not in resident:
            break
        hit = b
    return hit


class Cache:
    """Boundaries resident, keyed by the chain hash at b; LRU among leaves."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.nodes: collections.OrderedDict[int, dict] = collections.OrderedDict()

    def admit(self, tokens: list[int], hashes: list[int]) -> tuple[int, list, list]:
        """(hit tokens, boundaries stored, boundaries evicted) for one prompt, as an engine would:
        the hit is read first, then the prompt's full boundaries are stored."""
        hit = hit_tokens(self.nodes, hashes, len(tokens))
        stored, evicted = [], []
        parent = None
        for b in range(BOUNDARY_TOKENS, len(tokens) + 1, BOUNDARY_TOKENS):
            key = hashes[b // HASH_UNIT_TOKENS]
            if key in self.nodes:
                self.nodes.move_to_end(key)
            else:
                self.nodes[key] = {"b": b, "parent": parent, "children": 0}
                if parent is not None:
                    self.nodes[parent]["children"] += 1
                stored.append(b)
            parent = key
        while len(self.nodes) > self.capacity:
            victim = next((k for k, n in self.nodes.items() if n["children"] == 0), None)
            if victim is None:
                break
            node = self.nodes.pop(victim)
            if node["parent"] in self.nodes:
                self.nodes[node["parent"]]["children"] -= 1
            evicted.append((victim, node["b"]))
        return hit, stored, evicted


def stored_events(tokens: list[int], hashes: list[int], b: int) -> list[dict]:
    out = []
    for g, kind, size, window, tail in GROUPS:
        start = b - size * tail
        ev = {"type": "BlockStored",
              "block_hashes": [hashes[(start + size * (i + 1)) // HASH_UNIT_TOKENS] for i in range(tail)],
              "parent_block_hash": hashes[start // HASH_UNIT_TOKENS] if start > 0 else None,
              "token_ids": tokens[start:b], "block_size": size, "lora_id": None, "medium": "GPU",
              "lora_name": None, "group_idx": g, "kv_cache_spec_kind": kind}
        if window is not None:
            ev["kv_cache_spec_sliding_window"] = window
        out.append({k: v for k, v in ev.items() if v is not None})   # vLLM omits fields that are None
    return out


def removed_events(hashes_at: dict, b: int) -> list[dict]:
    return [{"type": "BlockRemoved", "medium": "GPU", "group_idx": g,
             "block_hashes": [hashes_at[b - size * tail + size * (i + 1)] for i in range(tail)]}
            for g, _kind, size, _w, tail in GROUPS]


class Publisher:
    """vLLM's ZMQ publisher, with a replay buffer and the faults."""

    def __init__(self, ctx, host: str, port: int, replay_port: int, dp_rank: int, buffer_steps: int = 10000) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = _bind(self.pub, host, port)
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay_port = _bind(self.replay, host, replay_port)
        self.dp_rank = dp_rank
        self.seq = 0
        self.buffer: collections.deque = collections.deque(maxlen=buffer_steps)
        self.faults = {"event_delay_s": 0.0, "drop_batches": 0, "malformed": 0, "events_off": False}
        self.published = self.dropped = 0

    async def publish(self, events: list[dict]) -> None:
        seq, self.seq = self.seq, self.seq + 1
        payload = msgpack.packb([time.time(), events, self.dp_rank])
        f = self.faults
        if f["event_delay_s"] > 0:   # late on the wire and in the replay buffer alike, as a slow engine is
            asyncio.get_running_loop().call_later(f["event_delay_s"], self._emit, seq, payload)
        else:
            self._emit(seq, payload)

    def _emit(self, seq: int, payload: bytes) -> None:
        self.buffer.append((seq, payload))
        f = self.faults
        if f["events_off"]:
            return
        if f["drop_batches"] > 0:
            f["drop_batches"] -= 1
            self.dropped += 1
            return
        if f["malformed"] > 0:
            f["malformed"] -= 1
            payload = b"\xc1 not msgpack"
        self.published += 1
        self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    async def serve_replay(self) -> None:
        while True:
            frame = await self.replay.recv_multipart()
            if len(frame) != 3:
                continue
            client, _, start = frame
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= start_seq:
                    await self.replay.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload))
            await self.replay.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))


def _bind(sock, host: str, port: int) -> int:
    if port:
        sock.bind(f"tcp://{host}:{port}")
        return port
    return sock.bind_to_random_port(f"tcp://{host}")


class Replica:
    def __init__(self, args, publisher: Publisher) -> None:
        self.args = args
        self.pub = publisher
        self.cache = Cache(args.capacity_blocks)
        self.hashes_at: dict[int, dict[int, int]] = {}   # boundary key → {token end: hash} for removal
        self.running = 0
        self.served = 0
        self.http_faults = {"first_byte_delay_s": 0.0, "fail_status": 0, "fail_count": 0}
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self.lock = asyncio.Lock()

    @property
    def tokenizer(self):
        """Loaded once, in the background from startup (transformers takes seconds to import)."""
        with self._tokenizer_lock:
            if self._tokenizer is None and self.args.tokenizer:
                from transformers import AutoTokenizer
                self._tokenizer = AutoTokenizer.from_pretrained(self.args.tokenizer)
        return self._tokenizer

    def _tokens(self, body: dict, chat: bool) -> list[int]:
        if chat:
            if self.tokenizer is None:
                raise web.HTTPBadRequest(text='{"error": "no tokenizer"}')
            # as vLLM's chat endpoint does: the template rendered to text, tokenized without special tokens
            text = self.tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise web.HTTPBadRequest(text='{"error": "no tokenizer"}')
            return self.tokenizer(prompt)["input_ids"]
        return list(prompt)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("chat/completions")
        body = await request.json()
        f = self.http_faults
        if f["fail_count"] > 0:
            f["fail_count"] -= 1
            return web.json_response({"error": {"message": "injected", "code": f["fail_status"]}},
                                     status=f["fail_status"])
        if chat or not isinstance(body.get("prompt"), list):   # the tokenizer may still be loading: off the loop
            tokens = await asyncio.get_running_loop().run_in_executor(None, self._tokens, body, chat)
        else:
            tokens = self._tokens(body, chat)
        self.running += 1
        try:
            if f["first_byte_delay_s"] > 0:
                await asyncio.sleep(f["first_byte_delay_s"])
            async with self.lock:   # one engine step at a time: the hit, then the events it publishes
                hit = await self._admit(tokens)
            self.served += 1
            return await self._answer(request, body, chat, len(tokens), hit)
        finally:
            self.running -= 1

    async def _admit(self, tokens: list[int]) -> int:
        hashes = chain_hashes(tokens)
        hit, stored, evicted = self.cache.admit(tokens, hashes)
        events = []
        for key, b in evicted:
            events += removed_events(self.hashes_at.pop(key), b)
        for b in stored:
            key = hashes[b // HASH_UNIT_TOKENS]
            self.hashes_at[key] = {e: hashes[e // HASH_UNIT_TOKENS] for e in range(b - 128, b + 1, 4)}
            events += stored_events(tokens, hashes, b)
        if events:
            await self.pub.publish(events)
        return hit

    async def _answer(self, request, body, chat, prompt_tokens, hit) -> web.StreamResponse:
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 4)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
                 "prompt_tokens_details": {"cached_tokens": hit}}
        rid = f"cmpl-{os.getpid()}-{self.served}"
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            choice = ({"index": 0, "message": {"role": "assistant", "content": "ok " * n}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": "ok " * n, "finish_reason": "length"})
            return web.json_response({"id": rid, "object": obj, "model": body.get("model"), "choices": [choice],
                                      "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunks = self.args.stream_chunks
        for i in range(chunks):
            delta = {"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
            chunk = {"id": rid, "object": obj + ".chunk" if chat else obj, "model": body.get("model"),
                     "choices": [{"index": 0, **delta, "finish_reason": "length" if i == chunks - 1 else None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if self.args.chunk_delay_s:
                await asyncio.sleep(self.args.chunk_delay_s)
        if (body.get("stream_options") or {}).get("include_usage"):
            chunk = {"id": rid, "object": obj, "model": body.get("model"), "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def metrics(self, request):
        text = (f'vllm:num_requests_running{{engine="0",model_name="fake"}} {self.running}\n'
                f'vllm:num_requests_waiting{{engine="0",model_name="fake"}} 0\n')
        return web.Response(text=text)

    async def faults(self, request):
        body = await request.json()
        for k, v in body.items():
            if k in self.pub.faults:
                self.pub.faults[k] = v
            elif k == "fail_status":
                self.http_faults["fail_status"], self.http_faults["fail_count"] = int(v), int(body.get("fail_count", 1))
            elif k in self.http_faults:
                self.http_faults[k] = v
        return web.json_response({"events": self.pub.faults, "http": self.http_faults})

    async def clear(self, request):
        async with self.lock:
            self.cache = Cache(self.args.capacity_blocks)
            self.hashes_at.clear()
            await self.pub.publish([{"type": "AllBlocksCleared"}])
        return web.json_response({"cleared": True})

    async def info(self, request):
        return web.json_response({"served": self.served, "seq": self.pub.seq, "published": self.pub.published,
                                  "dropped": self.pub.dropped, "boundaries": len(self.cache.nodes)})


def make_app(replica: Replica) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", replica.complete)
    app.router.add_post("/v1/chat/completions", replica.complete)
    app.router.add_get("/v1/models", lambda r: web.json_response(
        {"object": "list", "data": [{"id": replica.args.model, "object": "model", "owned_by": "fake"}]}))
    app.router.add_get("/health", lambda r: web.Response(text=""))
    app.router.add_get("/metrics", replica.metrics)
    app.router.add_post("/_fake/faults", replica.faults)
    app.router.add_post("/_fake/clear", replica.clear)
    app.router.add_get("/_fake/info", replica.info)
    return app


async def main(args) -> None:
    ctx = zmq.asyncio.Context()
    pub = Publisher(ctx, "127.0.0.1", args.events_port, args.replay_port, args.dp_rank)
    replica = Replica(args, pub)
    runner = web.AppRunner(make_app(replica), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.http_port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    asyncio.get_running_loop().create_task(pub.serve_replay())
    if args.tokenizer:   # loaded beside the event loop: ready before the first text prompt, startup not held up
        asyncio.get_running_loop().run_in_executor(None, lambda: replica.tokenizer)
    print(json.dumps({"http": f"http://127.0.0.1:{port}", "events": f"tcp://127.0.0.1:{pub.port}",
                      "replay": f"tcp://127.0.0.1:{pub.replay_port}", "pid": os.getpid()}), flush=True)
    await asyncio.Event().wait()


def parse(argv=None):
    p = argparse.ArgumentParser(description="a fake vLLM replica for kvatlas route's tests")
    p.add_argument("--http-port", type=int, default=0)
    p.add_argument("--events-port", type=int, default=0)
    p.add_argument("--replay-port", type=int, default=0)
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--model", default="deepseek-v4-flash")
    p.add_argument("--tokenizer")
    p.add_argument("--capacity-blocks", type=int, default=4096)
    p.add_argument("--stream-chunks", type=int, default=4)
    p.add_argument("--chunk-delay-s", type=float, default=0.0)
    return p.parse_args(argv)


if __name__ == "__main__":
    try:
        asyncio.run(main(parse()))
    except KeyboardInterrupt:
        sys.exit(0)
