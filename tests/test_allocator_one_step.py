"""A one-token step of one request takes the allocator's scalar path (`_write_one`); it must be the
general path to the bit: two caches driven alike, one with the scalar path and one without, hand
out the same indices at every call and hold the same state after it (lengths, tables, free lists,
ledger, the prefix cache's tree), over random lifecycles of single-request decode steps crossing
full-page and SWA-page boundaries, mixed with admissions, chunks, batched steps, rollbacks and
finishes, with and without the prefix cache."""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvatlas  # noqa: E402
from kvatlas import KvatlasError  # noqa: E402
from kvatlas.alloc import allocator as alloc_mod  # noqa: E402
from test_allocator import fingerprint  # noqa: E402

VOCAB = 50


def _same(x, y, what: str) -> None:
    if isinstance(x, np.ndarray):
        assert isinstance(y, np.ndarray) and x.dtype == y.dtype and np.array_equal(x, y), what
    elif isinstance(x, dict):
        assert x.keys() == y.keys(), what
        for k in x:
            _same(x[k], y[k], f"{what}[{k}]")
    elif isinstance(x, tuple):
        assert len(x) == len(y), what
        for i, (a, b) in enumerate(zip(x, y)):
            _same(a, b, f"{what}[{i}]")
    else:
        assert x == y, what


def _both(caches, fn):
    """fn(cache) on the scalar-path cache and on the general one: the same result or the same error."""
    out = []
    for fast, c in zip((True, False), caches):
        alloc_mod.ONE_STEP = fast
        try:
            out.append(("ok", fn(c)))
        except KvatlasError as e:   # refused (a full pool, past max_model_len): alike, and changing nothing
            out.append(("refused", f"{type(e).__name__}: {e}"))
        finally:
            alloc_mod.ONE_STEP = True
    (k0, v0), (k1, v1) = out
    assert k0 == k1, out
    if dataclasses.is_dataclass(v0):   # WriteIndices: every field, arrays with their dtypes
        for f in dataclasses.fields(v0):
            _same(getattr(v0, f.name), getattr(v1, f.name), f.name)
    else:
        assert v0 == v1, out
    return k0 == "ok"


def _state(c):
    tree = c.prefix.tree if c.prefix is not None else None
    extra = () if tree is None else (len(tree.nodes), tree.checkpoints, tree.idle_pages)
    return fingerprint(c), c.ledger.snapshot(), extra


@pytest.mark.parametrize("model,prefix", [("tiny-v4", False), ("tiny-v4.1", False), ("tiny-v4", True)])
@pytest.mark.parametrize("seed", range(2))
def test_scalar_one_token_step_is_the_general_step(model, prefix, seed):
    opts = dict(max_model_len=1500, chunked_prefill_tokens=300, draft_tokens=2)
    if prefix:
        opts["prefix_checkpoints"] = 8
    p = kvatlas.plan(model, "32MiB", max_running_requests=4, **opts)
    caches = (kvatlas.allocate(p), kvatlas.allocate(p))
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB, 600)
    running: dict = {}   # id -> token ids (prompt, then what it wrote)
    next_id, ones = 0, 0
    for _ in range(350):
        op = rng.choice(["admit", "extend", "one", "one", "one", "one", "batch", "rollback", "finish", "flush"])
        if op == "admit" or not running:
            n = int(rng.integers(1, 500))
            ids = np.concatenate((system[: int(rng.integers(0, 600))], rng.integers(0, VOCAB, n)))
            kw = {"token_ids": ids} if prefix else {}
            rid, new = next_id, int(rng.integers(0, 400))
            next_id += 1
            if _both(caches, lambda c: c.admit(rid, len(ids), new, **kw).cached_tokens):
                running[rid] = list(ids)
        elif op == "extend":
            rid = list(running)[int(rng.integers(len(running)))]
            k = int(rng.integers(1, 300))
            _both(caches, lambda c: c.extend(rid, k))
        elif op == "one":   # one request, one token: most of them cross no page
            rid = list(running)[int(rng.integers(len(running)))]
            for _ in range(int(rng.integers(1, 80))):   # (every call's indices compared; the
                ones += 1                                     # state after the run of steps, below)
                if not _both(caches, lambda c: c.step([rid], 1)):
                    break
        elif op == "batch":
            batch = list(running)[: int(rng.integers(1, len(running) + 1))]
            k = int(rng.integers(1, 4))
            _both(caches, lambda c: c.step(batch, k))
        elif op == "rollback":
            rid = list(running)[int(rng.integers(len(running)))]
            a = caches[0].allocator
            k = int(rng.integers(0, 1 + a.last_write[a.slot_of[rid]]))
            _both(caches, lambda c: c.rollback(rid, k))
        elif op == "finish":
            rid = list(running)[int(rng.integers(len(running)))]
            n = int(caches[0].allocator.length[caches[0].allocator.slot_of[rid]])
            prompt = running.pop(rid)
            seq = np.concatenate((prompt, rng.integers(0, VOCAB, max(0, n - len(prompt)))))
            kw = {"token_ids": seq} if prefix and n >= len(prompt) else {}
            _both(caches, lambda c: c.finish(rid, **kw))
        else:
            _both(caches, lambda c: c.flush())
        assert _state(caches[0]) == _state(caches[1])
        for c in caches:
            c.check_integrity()
    assert ones > 1000
