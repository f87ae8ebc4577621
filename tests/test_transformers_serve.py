"""Many users through one paged cache: 16 multi-turn sessions of different lengths, interleaved by
the serving loop (admission and eviction by kvatlas, chunked prefill, decode, finish; no padding
anywhere), each request getting the greedy tokens it gets alone with the model's own cache;
integrity after every step; at the end the cache holds exactly what its prefix cache holds."""

import numpy as np
import pytest
import torch

from hf_sessions import alone, check, server, settle
from hf_tiny import VOCAB, model as tiny_model
from kvatlas.errors import KvatlasError, PoolExhaustedError, RequestStateError

SESSIONS, TURNS = 16, 2


def test_sixteen_interleaved_sessions_get_what_they_get_alone():
    m = tiny_model(torch.float32, seed=11)
    rng = np.random.default_rng(5)
    systems = [rng.integers(0, VOCAB, n) for n in (300, 140)]
    srv = server(m, "64MiB", requests=6, checkpoints=8, max_len=1024)
    history = {s: np.concatenate((systems[s % 2], rng.integers(0, VOCAB, int(rng.integers(5, 200)))))
               for s in range(SESSIONS)}
    for s in range(SESSIONS):
        srv.submit((s, 0), history[s], int(rng.integers(2, 6)))
    done, running_most, steps = [], 0, 0
    while not srv.idle:
        finished = srv.step()
        steps += 1
        check(srv)
        running_most = max(running_most, len(srv.running))
        for req in finished:
            done.append(req)
            s, k = req.request_id
            if k + 1 < TURNS:   # the user answers: the next turn re-sends the conversation
                history[s] = np.concatenate((req.sequence, rng.integers(0, VOCAB, int(rng.integers(5, 80)))))
                srv.submit((s, k + 1), history[s], int(rng.integers(2, 5)))
    assert len(done) == SESSIONS * TURNS and running_most == 6, "sessions ran together, up to the slots"
    assert sum(1 for r in done if r.cached_tokens) >= 12, "later turns and shared system prompts hit"
    lengths = {len(r.prompt) for r in done}
    assert len(lengths) > SESSIONS, "requests of different lengths"
    for req in done:
        tokens, _ = alone(m, req.sequence, len(req.prompt), req.max_new_tokens)
        assert tokens == req.tokens, f"{req.request_id}: {req.tokens} alone {tokens}"
    settle(srv)
    assert srv.passes == sum(len(r.passes) for r in done)


def test_server_refuses_bad_requests():
    m = tiny_model(torch.float32)
    srv = server(m, "64MiB", requests=2, max_len=1024)
    srv.submit("a", [1, 2, 3], 2)
    with pytest.raises(RequestStateError, match="submitted already"):
        srv.submit("a", [1, 2], 2)
    with pytest.raises(KvatlasError, match="empty"):
        srv.submit("b", [], 2)
    with pytest.raises(KvatlasError, match="max_new_tokens"):
        srv.submit("c", [1], 0)
    with pytest.raises(KvatlasError, match="max_model_len"):
        srv.submit("d", np.arange(1100) % VOCAB, 4)
    srv.submit("e", np.arange(900) % VOCAB, 3)
    assert set(srv.run()) == {"a", "e"}
    check(srv)
    small = server(m, "64MiB", requests=1, max_len=1024)
    small.kv.admit("other", 1000, 20)   # someone else holds the pages and the only slot
    small.submit("f", [1, 2, 3], 2)
    with pytest.raises(PoolExhaustedError):
        small.step()                      # nothing of ours runs that could free them: refused, not waited on
    check(small)


def test_the_server_passes_its_cache_by_the_keyword_the_model_takes():
    """transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns,
    and goes in 5.40); 5.23 knows only the old one. The server gives the name the model takes."""
    import inspect

    import transformers
    m = tiny_model(torch.float32, seed=3)
    srv = server(m, "64MiB", requests=2, checkpoints=4, max_len=512)
    forward, seen = m.forward, []

    def spy(*args, **kw):
        seen.append(sorted(set(kw) & {"cache", "past_key_values"}))
        return forward(*args, **kw)
    m.forward = spy
    srv.submit("a", np.arange(300) % VOCAB, 3)
    while not srv.idle:
        srv.step()
    want = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24):
        assert want == "cache"
    assert len(seen) == 2 + 2 and all(s == [want] for s in seen)   # two prefill chunks, then a pass a token
