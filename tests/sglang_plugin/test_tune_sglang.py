"""`kvatlas tune`'s SGLang flags checked against SGLang 0.5.23's own code on the CPU: its argument
pipeline and configurator, started with the recommended flags, build pools of exactly the
predicted size; and two alternating 1M-token sessions, replayed on SGLang's own allocator, keep
the prefix tails both need with those flags (SGLang's cap-mode pool is too small to)."""

import pytest
import torch

from kvatlas.advice import profile, tune
from kvatlas.driving.traces import read_trace
from kvatlas.driving.workload import Request
from kvatlas.integrations.sglang.plugin import build_offline

HEAD = "tests/data/mooncake_head.jsonl"
GIB = 2**30


def _build(flags, budget, **kw):
    return build_offline("deepseek-v4-flash", budget, max_running_requests=flags["--max-running-requests"],
                         chunked_prefill_tokens=flags["--chunked-prefill-size"],
                         swa_ratio=flags.get("--swa-full-tokens-ratio"), **kw)


def test_pools_built_with_the_tuned_flags_hold_the_predicted_capacity(plugins_loaded):
    reqs, _ = read_trace(HEAD)
    t = tune("deepseek-v4-flash", profile(reqs), tp=4)   # the KV budget of one H200 at TP 4, weights from the config
    e = t.engine("sglang")
    for setting, extra in ((e.tuned, {"context_length": e.tuned.flags["--context-length"]}), (e.default, {})):
        alloc = _build(setting.flags, t.budget_bytes, **extra).pools.token_to_kv_pool_allocator
        assert alloc.full_available_size() == setting.reported["max_total_num_tokens"] == setting.token_capacity
        assert alloc.swa_available_size() == setting.reported["swa_tokens"]
    assert e.tuned.token_capacity > e.default.token_capacity


def _two_sessions(first: int, followup: int, output: int, turns: int) -> list:
    """Sessions A and B, turns alternating A1 B1 A2 B2 …; each first prompt `first` tokens."""
    out, prev = [], {}
    for k in range(turns):
        for s in "AB":
            prompt = first if k == 0 else prev[s].prompt_tokens + prev[s].output_tokens + followup
            r = Request(id=f"{s}{k}", arrival_s=0.0, prompt_tokens=prompt, output_tokens=output,
                        after=None if k == 0 else prev[s].id)
            out.append(r)
            prev[s] = r
    return out


class Replay:
    """Prefix reuse on SGLang's own allocator, the way its radix cache and scheduler use it
    (read from 0.5.23's source): a prefill allocates full and SWA slots chunk by chunk and frees
    no SWA while it runs (with prefix sharing on, `maybe_evict_swa` skips extend batches); when
    the SWA pool is short, the tree's SWA LRU evicts first the tails of requests that finished
    earlier (older than the running prefill's own slots), then the prefill's own out-of-window
    slots; a finished request keeps its full slots and its tail (window, page-rounded) cached."""

    def __init__(self, alloc, window: int, chunk: int):
        self.a, self.window, self.chunk, self.page = alloc, window, chunk, alloc.page_size
        self.cached = {}    # session → full indices of its cached sequence, while its tail lives
        self.tails = {}     # session → SWA-holding full indices of its tail
        self.lost = []

    def _extend(self, idx, n):
        t = lambda v: torch.tensor([v], dtype=torch.int64)
        last = idx[-1:] if len(idx) else torch.tensor([-1])
        return self.a.alloc_extend(t(len(idx)), t(len(idx)), t(len(idx) + n), t(len(idx) + n), last, n)

    def _make_room(self, session, idx, own_freed):
        for other in [s for s in self.tails if s != session]:   # the oldest evictable SWA first
            self.a.free_swa_segment(self.tails.pop(other), start_pos=0)
            self.cached.pop(other)
            self.lost.append(other)
            return own_freed
        edge = (len(idx) - self.window) // self.page * self.page   # then its own out-of-window slots
        assert edge > own_freed, "nothing left to evict"
        self.a.free_swa_segment(idx[own_freed:edge], start_pos=own_freed)
        return edge

    def turn(self, session, req) -> int:
        """Run one request; returns the prompt tokens it resumed from cache."""
        idx = self.cached.get(session, torch.empty(0, dtype=torch.int64))
        hit = len(idx)
        if hit:
            self.tails.pop(session)       # its tail is read again: the running request holds it
        own_freed = max(0, (hit - self.window) // self.page * self.page)   # the cached prefix's tombstones
        todo = req.prompt_tokens + req.output_tokens - hit
        while todo:
            n = min(self.chunk, todo)
            got = self._extend(idx, n)
            while got is None:
                own_freed = self._make_room(session, idx, own_freed)
                got = self._extend(idx, n)
            idx, todo = torch.cat([idx, got]), todo - n
        keep = max(0, (len(idx) - self.window) // self.page * self.page)   # finish: the tail stays
        if keep > own_freed:
            self.a.free_swa_segment(idx[own_freed:keep], start_pos=own_freed)
        self.cached[session], self.tails[session] = idx, idx[keep:]
        return hit


def _replay(alloc, reqs):
    # the replay's allocation step: nothing is freed inside a prefill, so its size changes no
    # count; large steps keep the replay fast, at most half the SWA pool so eviction can make room
    step = min(262144, alloc.swa_available_size() // 2 // alloc.page_size * alloc.page_size)
    r = Replay(alloc, window=128, chunk=step)
    hits = [r.turn(q.id[0], q) for q in reqs]
    return hits, r.lost


def test_two_alternating_1m_sessions_keep_both_tails_with_the_tuned_flags(plugins_loaded):
    reqs = _two_sessions(first=1_000_000, followup=2_000, output=200, turns=2)
    budget = 48 * GIB   # both sessions' full KV (7.8 GB) and one 1M-token prefill's SWA (31.9 GB)
    t = tune("deepseek-v4-flash", profile(reqs), engines=("sglang",), memory_bytes=budget)
    e = t.engine("sglang")
    flags = e.tuned.flags
    tuned = _build(flags, budget, context_length=flags["--context-length"]).pools.token_to_kv_pool_allocator
    assert tuned.swa_available_size() == e.tuned.reported["swa_tokens"]
    hits, lost = _replay(tuned, reqs)
    assert lost == [] and hits == [0, 0, reqs[0].prompt_tokens + reqs[0].output_tokens,
                                   reqs[1].prompt_tokens + reqs[1].output_tokens]
    # the same request limit in SGLang's cap mode (what its release comment calls the default):
    # its own pool has fewer SWA slots than B's first prefill holds, so that prefill must evict A's
    # tail (the oldest SWA in the tree) and A's next turn resumes nothing
    cap = build_offline("deepseek-v4-flash", budget, max_running_requests=flags["--max-running-requests"],
                        chunked_prefill_tokens=flags["--chunked-prefill-size"], swa_mode="cap",
                        context_length=flags["--context-length"]).pools.token_to_kv_pool_allocator
    assert cap.swa_available_size() < reqs[1].prompt_tokens + reqs[1].output_tokens
    assert cap.full_available_size() > tuned.full_available_size() > 2 * reqs[2].prompt_tokens
