"""Server: many requests through one paged kvatlas cache and one transformers DeepSeek-V4 model.

A small continuous-batching loop, greedy. Each `step()`: admit waiting requests, first come first
served, while kvatlas can admit them (the prefix cache evicts what it must; with a host tier the
pages and resume point a prompt reaches come back first); then one forward pass per running
request: its next prefill chunk, or one decode token. A request that hits the prefix cache feeds
the model only the suffix (`Request.cached_tokens` are never computed). A finished request's
pages and resume points join the prefix cache.

No padding anywhere: transformers' DeepSeek-V4 keeps one compression-window position per layer
for a whole batch, so requests of different lengths never share a pass; each pass is one request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ...checks import whole
from ...errors import KvatlasError, PoolExhaustedError, RequestStateError


@dataclass(slots=True)
class Request:
    request_id: object
    prompt: np.ndarray
    max_new_tokens: int
    tokens: list = field(default_factory=list)       # generated so far
    cached_tokens: int = 0                            # prompt tokens the prefix cache supplied
    computed: int = 0                                 # prompt tokens in the cache (supplied or fed)
    passes: list = field(default_factory=list)        # tokens fed per forward pass, in order
    logits: list = field(default_factory=list)        # the logits of each sampled token (keep_logits)
    done: bool = False

    @property
    def sequence(self) -> np.ndarray:
        return np.concatenate((self.prompt, np.asarray(self.tokens, np.int64)))


class Server:
    """`cache`: a KvatlasCache (kvatlas_cache_for(model, ...)); `chunk_tokens`: prefill tokens per
    pass (default: the plan's chunked_prefill_tokens); `host`: a HostLink (kvatlas.tiers.
    attach_host_tier(cache.kv, ...)); `keep_logits`: keep each sampled token's logits."""

    def __init__(self, model, cache, *, chunk_tokens: int | None = None, host=None, keep_logits: bool = False,
                 eos_token_id: int | None = None) -> None:
        self.model, self.cache, self.kv, self.host = model, cache, cache.kv, host
        most = self.kv.plan.options.chunked_prefill_tokens
        self.chunk = whole("chunk_tokens", most if chunk_tokens is None else chunk_tokens, 1, most)
        self.keep_logits, self.eos = keep_logits, eos_token_id
        self.waiting: deque = deque()
        self.running: dict = {}
        self.finished: dict = {}
        self.passes = 0

    def submit(self, request_id, prompt_ids, max_new_tokens: int) -> Request:
        prompt = np.asarray(prompt_ids, np.int64).reshape(-1)
        whole("max_new_tokens", max_new_tokens, 1)
        if not len(prompt):
            raise KvatlasError("prompt_ids: empty; give at least one token")
        most = self.kv.plan.options.max_model_len
        if len(prompt) + max_new_tokens > most:
            raise KvatlasError(f"prompt_ids: {len(prompt)} tokens + max_new_tokens {max_new_tokens} exceed "
                               f"max_model_len {most}; shorten the request or plan a larger max_model_len")
        known = request_id in self.running or request_id in self.finished or \
            any(r.request_id == request_id for r in self.waiting)
        if known:
            raise RequestStateError(f"request_id {request_id!r} was submitted already; use a new id")
        req = Request(request_id, prompt, max_new_tokens)
        self.waiting.append(req)
        return req

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def run(self, max_steps: int = 1_000_000) -> dict:
        """Step until every submitted request has finished; the finished requests by id."""
        for _ in range(max_steps):
            if self.idle:
                return self.finished
            self.step()
        raise KvatlasError(f"run: requests still running after {max_steps} steps")

    def step(self) -> list[Request]:
        """Admit what fits, then one pass per running request; the requests finished in it."""
        self._admit()
        done = []
        for req in list(self.running.values()):
            if self._advance(req):
                done.append(req)
        return done

    # ------------------------------------------------------------------ admission
    def _admit(self) -> None:
        while self.waiting:
            req = self.waiting[0]
            n = len(req.prompt)
            if self.host is not None:
                ready = self.host.prefetch(n, token_ids=req.prompt)
                if ready is not None:
                    ready.wait()   # before the request's first forward pass
            if not self.kv.can_admit(n, req.max_new_tokens, token_ids=req.prompt):
                if not self.running:
                    raise PoolExhaustedError("full_pages", n + req.max_new_tokens, 0, "tokens",
                                             f"admission of {req.request_id!r} into an idle cache")
                return
            adm = self.kv.admit(req.request_id, n, req.max_new_tokens, token_ids=req.prompt)
            req.cached_tokens = req.computed = adm.cached_tokens
            self.running[req.request_id] = self.waiting.popleft()

    # ------------------------------------------------------------------ passes
    def _advance(self, req: Request) -> bool:
        if req.computed < len(req.prompt):
            ids = req.prompt[req.computed: req.computed + self.chunk]
            req.computed += len(ids)
            logits = self._forward(req, ids)
            if req.computed < len(req.prompt):
                return False
        else:
            logits = self._forward(req, np.asarray(req.tokens[-1:], np.int64))
        token = int(logits.argmax())
        req.tokens.append(token)
        if self.keep_logits:
            req.logits.append(logits)
        if len(req.tokens) < req.max_new_tokens and token != self.eos:
            return False
        self._finish(req)
        return True

    def _forward(self, req: Request, ids: np.ndarray) -> torch.Tensor:
        x = torch.as_tensor(ids, dtype=torch.long, device=self.kv.device)[None]
        with torch.no_grad():
            out = self.model(input_ids=x, past_key_values=self.cache.bind([req.request_id]), use_cache=True,
                             logits_to_keep=1)
        req.passes.append(len(ids))
        self.passes += 1
        return out.logits[0, -1]

    def _finish(self, req: Request) -> None:
        self.cache.bind(())
        self.kv.finish(req.request_id, token_ids=req.sequence)
        req.done = True
        del self.running[req.request_id]
        self.finished[req.request_id] = req
