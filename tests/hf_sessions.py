"""References for serving the tiny DeepSeek-V4 through kvatlas: each request run alone with the
model's own cache (DynamicCache), greedy, one-shot or with given forward passes."""

from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache

from kvatlas.integrations.transformers import kvatlas_cache_for
from kvatlas.integrations.transformers.serve import Server
from kvatlas.prefix import page_keys

from hf_tiny import cache_kw


def alone(m, sequence, prompt_len: int, new_tokens: int, passes=None):
    """Greedy tokens and their logits for `sequence[:prompt_len]` run alone with the model's own
    cache. `passes`: the forward sizes over the prompt (default: one pass); every decode pass is
    one token. Decoding feeds the model's own tokens."""
    own = DynamicCache(config=m.config)
    passes = list(passes) if passes is not None else [prompt_len]
    assert sum(passes) == prompt_len, (passes, prompt_len)
    ids = torch.as_tensor(np.asarray(sequence[:prompt_len], np.int64), device=m.device)[None]
    tokens, logits, at = [], [], 0
    with torch.no_grad():
        for n in passes:
            out = m(ids[:, at:at + n], **cache_kw(m, own), use_cache=True, logits_to_keep=1).logits[0, -1]
            at += n
        for _ in range(new_tokens):
            tokens.append(int(out.argmax()))
            logits.append(out)
            if len(tokens) == new_tokens:
                break
            out = m(torch.tensor([[tokens[-1]]], device=m.device), **cache_kw(m, own), use_cache=True).logits[0, -1]
    return tokens, logits


def truncate(passes, tokens: int):
    """The passes that computed the first `tokens` positions, or None when no pass ends there."""
    out, at = [], 0
    for n in passes:
        if at == tokens:
            return out
        out.append(n)
        at += n
    return out if at == tokens else None


class RecordingServer(Server):
    """A Server that knows, for every cached page and resume point, the forward passes that
    computed it from position 0 (its producer's history). A request that hits at boundary b was
    then computed by: its producer's passes up to b, then its own (`history_of`). A cached path
    whose pages or resume point come from producers with other histories (two requests computed
    the same prefix, one's duplicates were dropped, the other's later pages kept) has no single
    cold schedule: `history_of` says None then."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.pages, self.points, self.parent = {}, {}, {}

    def _tree(self):
        return self.kv.prefix.tree.nodes

    def history_of(self, req):
        b = req.cached_tokens
        if not b:
            return list(req.passes)
        keys = page_keys(req.prompt[:b], self.kv.allocator.P).tolist()
        deepest = self.points.get(keys[-1])
        if deepest is None or self.pages.get(keys[-1]) is None:
            return None
        for j, k in enumerate(keys, 1):
            if self.pages.get(k) != truncate(deepest, j * self.kv.allocator.P):
                return None
        return truncate(deepest, b) + list(req.passes)

    def _finish(self, req) -> None:
        nodes = self._tree()
        before = {k: n.checkpoint for k, n in nodes.items()}   # (the objects: no id reused meanwhile)
        history = self.history_of(req)
        super()._finish(req)
        P = self.kv.allocator.P
        for k, n in self._tree().items():
            if k not in before:
                self.pages[k] = truncate(history, n.depth * P) if history is not None else None
            if n.checkpoint is not None and before.get(k) is not n.checkpoint:
                self.points[k] = truncate(history, n.depth * P) if history is not None else None


def server(m, memory="96MiB", *, host=None, chunk=256, checkpoints=8, requests=4, max_len=2048, **kw):
    """A Server over an exact-layout cache with the prefix cache on (and a host tier of `host` bytes)."""
    cache = kvatlas_cache_for(m, memory, layout="exact", max_running_requests=requests, max_model_len=max_len,
                              chunked_prefill_tokens=chunk, prefix_checkpoints=checkpoints, **kw)
    # (the recording below learns a page's producer when it finishes: pages shared at finish, so no
    # page joins the cache from a request still running, whose history is not known yet)
    cache.kv.prefix.share_as_written = False
    link = None
    if host is not None:
        from kvatlas.tiers import attach_host_tier
        link = attach_host_tier(cache.kv, host, checkpoint_share=0.5)
    return RecordingServer(m, cache, chunk_tokens=chunk, host=link, keep_logits=True)


def check(srv) -> None:
    srv.kv.check_integrity()
    if srv.host is not None:
        srv.host.tier.check_integrity()


def settle(srv) -> None:
    """Every request finished: what the cache holds is exactly what its prefix cache holds."""
    check(srv)
    snap = srv.kv.ledger.snapshot()
    assert snap.running_requests == 0
    assert snap.occupied_bytes == snap.evictable_bytes == srv.kv.prefix.cached_bytes()


def same_logits(got, want) -> bool:
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
