"""Prefix-cache exactness: a request that resumes from cached pages and then writes its suffix
reads back, for every pool and layer, exactly what the same request run cold reads (SWA window,
C4/C128 KV, indexer keys, compressor state rows), over random sessions with shared prefixes,
multi-turn follow-ups, chunked prefill, drafts with rollback and eviction; integrity after
every operation. The cold twin of each request runs in a second cache that never hits."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas import allocate, plan
from kvatlas.errors import PoolExhaustedError
from prefix_model import Model, assert_same_reads, prefix_hashes

SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
CHUNK = 256


class Req:
    def __init__(self, seq, prompt):
        self.seq, self.prompt = np.asarray(seq, np.int64), prompt
        self.hashes = prefix_hashes(self.seq)
        self.written = 0


def make_plan(draft_tokens):
    # pipeline stage 0 of 2: one SWA-only, one C4 and one C128 layer, half the work of all six
    return plan("tiny-v4", "16MiB", max_model_len=2048, max_running_requests=2, prefix_checkpoints=2,
                chunked_prefill_tokens=CHUNK, draft_tokens=draft_tokens, pp=2)


class Session:
    def __init__(self, p, device="cpu", impl="torch"):
        self.hot, self.cold = allocate(p, device=device), allocate(p, device=device)
        self.mh, self.mc = Model(self.hot, impl), Model(self.cold, impl)
        self.draft = p.options.draft_tokens
        self.running: dict = {}
        self.done: list = []
        self.next_id = 0
        self.hits = 0

    def check(self, where):
        self.hot.check_integrity()
        self.cold.check_integrity()
        for rid, r in self.running.items():
            if r.written:
                assert_same_reads(self.mh.reads(rid), self.mc.reads(rid), f"{where} {rid}")

    def write(self, rid, n, hashes, fn):
        self.mh.write(fn(self.hot), hashes)
        self.mc.write(fn(self.cold), hashes)

    def admit(self, seq, prompt, max_new):
        rid = f"r{self.next_id}"
        self.next_id += 1
        r = Req(seq, prompt)
        ok = self.hot.can_admit(prompt, max_new, token_ids=r.seq[:prompt])
        try:
            adm = self.hot.admit(rid, prompt, max_new, token_ids=r.seq[:prompt])
        except PoolExhaustedError:
            assert not ok, "can_admit said yes, admit refused"
            return
        assert ok, "admit succeeded where can_admit said no"
        self.cold.admit(rid, prompt, max_new)
        self.running[rid] = r
        self.hits += adm.cached_tokens > 0
        done = 0
        while done < adm.cached_tokens:   # the cold twin computes what the hot one took from the cache
            n = min(CHUNK, adm.cached_tokens - done)
            self.mc.write(self.cold.extend(rid, n), r.hashes[done:done + n])
            done += n
        r.written = adm.cached_tokens

    def extend(self, rid, n):
        r = self.running[rid]
        h = r.hashes[r.written:r.written + n]
        self.mh.write(self.hot.extend(rid, n), h)
        self.mc.write(self.cold.extend(rid, n), h)
        r.written += n

    def step(self, rid, tokens, accepted):
        r = self.running[rid]
        h = r.hashes[r.written:r.written + accepted]
        if tokens > accepted:   # rejected drafts: other tokens after the accepted ones
            seed = int(r.hashes[r.written + accepted - 1])
            h = np.concatenate((h, prefix_hashes(-1 - np.arange(tokens - accepted), seed)))
        self.mh.write(self.hot.step([rid], tokens), h)
        self.mc.write(self.cold.step([rid], tokens), h)
        for c in (self.hot, self.cold):
            c.rollback(rid, tokens - accepted)
        r.written += accepted

    def finish(self, rid):
        r = self.running.pop(rid)
        self.hot.finish(rid, token_ids=r.seq[:r.written])
        self.cold.finish(rid)
        self.done.append(r.seq[:r.written])


def draw_prompt(data, s, bases):
    kind = data.draw(st.sampled_from(["shared", "shared", "turn", "turn", "fresh"]), label="prompt kind")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="suffix seed"))
    if kind == "turn" and s.done:
        head = s.done[data.draw(st.integers(0, len(s.done) - 1), label="previous turn")]
    elif kind == "shared":
        head = bases[data.draw(st.integers(0, 1), label="base")][: data.draw(st.integers(200, 700), label="shared")]
    else:
        head = np.zeros(0, np.int64)
    suffix = rng.integers(0, 50_000, data.draw(st.integers(1, 200), label="suffix"))
    prompt = np.concatenate((head, suffix))[:900]
    max_new = data.draw(st.integers(1, 12), label="max_new")
    seq = np.concatenate((prompt, rng.integers(0, 50_000, max_new)))
    return seq, len(prompt), max_new


def run_session(data, draft_tokens, device="cpu", impl="torch", ops=40):
    s = Session(make_plan(draft_tokens), device, impl)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="base seed"))
    bases = [rng.integers(0, 50_000, 1200) for _ in range(2)]
    for i in range(ops):
        op = data.draw(st.sampled_from(["admit", "admit", "work", "work", "work", "finish", "flush"]), label="op")
        if op == "admit" and len(s.running) < 2:
            s.admit(*draw_prompt(data, s, bases))
        elif op == "work" and s.running:
            rid = data.draw(st.sampled_from(sorted(s.running)), label="request")
            r = s.running[rid]
            if r.written < r.prompt:
                most = min(CHUNK, r.prompt - r.written)
                whole = data.draw(st.booleans(), label="whole chunk")
                s.extend(rid, most if whole else data.draw(st.integers(1, most), label="chunk"))
            elif r.written < len(r.seq):
                left = len(r.seq) - r.written
                t = data.draw(st.integers(1, min(1 + s.draft, left)), label="tokens")
                s.step(rid, t, data.draw(st.integers(1, t), label="accepted"))
            else:
                s.finish(rid)
        elif op == "finish" and s.running:
            s.finish(data.draw(st.sampled_from(sorted(s.running)), label="finish"))
        elif op == "flush":
            s.hot.flush()
            s.cold.flush()
        s.check(f"op {i} {op}")
    for rid in list(s.running):
        s.finish(rid)
    s.check("end")
    assert s.hot.ledger.snapshot().evictable_bytes == s.hot.ledger.snapshot().occupied_bytes - \
        sum(p.measures.occupied_bytes for p in s.hot.ledger.snapshot().pools.values() if p.group == "request_slots")
    return s


@pytest.mark.parametrize("draft_tokens", [0, 3])
@settings(max_examples=8, deadline=None, suppress_health_check=SLOW)
@given(data=st.data())
def test_hit_then_suffix_reads_what_a_cold_run_reads(draft_tokens, data):
    run_session(data, draft_tokens)


@pytest.mark.gpu
@settings(max_examples=15, deadline=None, suppress_health_check=SLOW)
@given(data=st.data())
def test_hit_then_suffix_reads_what_a_cold_run_reads_triton(data):
    run_session(data, 3, device="cuda", impl="auto")


def scripted(device="cpu", impl="torch", draft_tokens=3):
    """Hits for sure: a shared system prompt, a follow-up turn, drafts with rejections, chunks
    that end off the page boundaries, and eviction of the oldest pages (16 pages in all)."""
    s = Session(make_plan(draft_tokens), device, impl)
    rng = np.random.default_rng(7)
    system = rng.integers(0, 50_000, 600)
    a = np.concatenate((system, rng.integers(0, 50_000, 120)))
    for rid_seq, prompt in ((np.concatenate((a, rng.integers(0, 50_000, 9))), 720),):
        s.admit(rid_seq, prompt, 9)
    rid = "r0"
    for n in (100, 256, 256, 108):
        s.extend(rid, n)
        s.check(f"extend {n}")
    for tokens, accepted in ((4, 2), (4, 4), (1, 1), (3, 1), (2, 1)):   # 9 accepted: the whole output
        s.step(rid, tokens, accepted)
        s.check(f"step {tokens}/{accepted}")
    s.finish(rid)
    s.check("finish r0")
    turn = np.concatenate((s.done[0], rng.integers(0, 50_000, 200)))
    s.admit(np.concatenate((turn, rng.integers(0, 50_000, 4))), len(turn), 4)
    s.admit(np.concatenate((system, rng.integers(0, 50_000, 300), rng.integers(0, 50_000, 4))), 900, 4)
    assert s.hits == 2, "both the follow-up turn and the shared system prompt hit"
    for rid in sorted(s.running):
        r = s.running[rid]
        while r.written < r.prompt:
            s.extend(rid, min(CHUNK, r.prompt - r.written))
            s.check(f"extend {rid}")
        s.step(rid, min(1 + s.draft, len(r.seq) - r.written), 1)
        s.check(f"step {rid}")
    for rid in sorted(s.running):
        s.finish(rid)
    for i in range(3):   # fill the cache with other prompts: the oldest pages are evicted
        s.admit(rng.integers(0, 50_000, 1500), 1400, 40)
        rid = f"r{s.next_id - 1}"
        if rid in s.running:
            while s.running[rid].written < 1400:
                s.extend(rid, min(CHUNK, 1400 - s.running[rid].written))
            s.check(f"filler {i}")
            s.finish(rid)
    assert s.hot.prefix.stats.evicted_pages > 0
    s.check("end")
    return s


def test_scripted_session_hits_and_reads_what_a_cold_run_reads():
    scripted()


@pytest.mark.gpu
def test_scripted_session_on_the_gpu_triton_path():
    scripted(device="cuda", impl="auto")
