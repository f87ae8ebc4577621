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

from ...checks import boolean, of_type, whole
from ...checks import request_id as check_request_id
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
        from ...tiers import HostLink
        from .cache import KvatlasCache
        from .model import cache_keyword, check_model
        check_model(model)
        of_type("cache", cache, KvatlasCache, "a KvatlasCache", "give kvatlas_cache_for(model, memory)")
        if host is not None and (not isinstance(host, HostLink) or host.prefix is not cache.kv.prefix):
            raise KvatlasError(f"host: {type(host).__name__} is not a host tier under this cache's prefix cache; "
                               "give kvatlas.tiers.attach_host_tier(cache.kv, ...), or None")
        boolean("keep_logits", keep_logits)
        self.vocab = int(getattr(model.config, "vocab_size", 0) or 0)
        if eos_token_id is not None:
            whole("eos_token_id", eos_token_id, 0, max(self.vocab - 1, 0))
        self.model, self.cache, self.kv, self.host = model, cache, cache.kv, host
        self._cache_kw = cache_keyword(model)
        most = self.kv.plan.options.chunked_prefill_tokens
        self.chunk = whole("chunk_tokens", most if chunk_tokens is None else chunk_tokens, 1, most)
        self.keep_logits, self.eos = keep_logits, eos_token_id
        self.waiting: deque = deque()
        self.running: dict = {}
        self.finished: dict = {}
        self.passes = 0

    def submit(self, request_id, prompt_ids, max_new_tokens: int) -> Request:
        """Queue a request: `prompt_ids` token ids of the model's vocabulary (a list, array or
        tensor of integers), checked here, not inside the model's embedding."""
        check_request_id(request_id)
        prompt = self._token_ids(prompt_ids)
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

    def _token_ids(self, prompt_ids) -> np.ndarray:
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.detach().cpu().numpy()
        if prompt_ids is None or isinstance(prompt_ids, (str, bytes, dict)):
            raise KvatlasError(f"prompt_ids: {type(prompt_ids).__name__} is not a list of token ids; give integers "
                               "(a tokenizer's input_ids)")
        try:
            arr = np.asarray(prompt_ids)
        except (TypeError, ValueError):   # ragged nesting
            arr = np.asarray([], dtype=object)
        if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer) or (arr.dtype == object and arr.size and all(
                isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in arr.reshape(-1)))):
            if arr.size or arr.dtype == object:
                raise KvatlasError(f"prompt_ids: {str(prompt_ids)[:40]!r} is not a list of integer token ids; give "
                                   "integers (a tokenizer's input_ids)")
        prompt = arr.astype(np.int64).reshape(-1) if arr.size else np.zeros(0, np.int64)
        if prompt.size and (prompt.min() < 0 or (self.vocab and prompt.max() >= self.vocab)):
            bad = int(prompt[(prompt < 0) | (prompt >= self.vocab if self.vocab else False)][0])
            raise KvatlasError(f"prompt_ids: token id {bad} is outside the model's vocabulary [0, {self.vocab}); give "
                               "ids its tokenizer produced")
        return prompt

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
            out = self.model(input_ids=x, **{self._cache_kw: self.cache.bind([req.request_id])}, use_cache=True,
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
