"""Prefix-cache exactness: a request that resumes from cached pages and then writes its suffix
reads back, for every pool and layer, exactly what the same request run cold reads (SWA window,
C4/C128 KV, indexer keys, compressor state rows), over random sessions with shared prefixes,
multi-turn follow-ups, chunked prefill, drafts with rollback and eviction; integrity after
every operation. The cold twin of each request runs in a second cache that never hits."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefix_session import CHUNK, Session, make_plan, scripted

SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]


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


def run_session(data, draft_tokens, device="cpu", impl="torch", ops=30):
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
@settings(max_examples=4, deadline=None, suppress_health_check=SLOW)
@given(data=st.data())
def test_hit_then_suffix_reads_what_a_cold_run_reads(draft_tokens, data):
    run_session(data, draft_tokens)


def test_scripted_session_hits_and_reads_what_a_cold_run_reads():
    scripted()

