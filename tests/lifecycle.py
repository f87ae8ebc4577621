"""One lifecycle call on a running request, chosen by (op, x): shared by the property tests of
the allocator and of the vmm backend, so both drive the cache the same way. And a run of
conversation turns one at a time (serve_turns), shared by the vmm tests on the stand-in and on
the GPU; and concurrent requests over shared system prompts (serve_shared_prompts), shared by a
vmm test and bench/prefix_cap.py."""

import numpy as np


def apply_op(cache, op: str, x: int, running: list) -> bool:
    """extend / step / rollback / finish / flush; True if the op applied. May raise."""
    if op == "flush":
        cache.flush()
        return True
    if not running:
        return False
    if op == "extend":
        cache.extend(running[x % len(running)], 1 + x % 300)
    elif op == "step":
        batch = [r for i, r in enumerate(running) if (x >> i) & 1] or running[:1]
        cache.step(batch, 1 + x % 4)
    elif op == "rollback":
        rid = running[x % len(running)]
        cache.rollback(rid, int(x % (1 + cache.allocator.last_write[cache.allocator.slot_of[rid]])))
    elif op == "finish":
        cache.finish(running.pop(x % len(running)))
    else:
        return False
    return True


def serve_turns(cache, requests: int, first: int, more: int, chunk: int, seed: int, after) -> None:
    """Requests one at a time, each second the next turn of the one before (its prompt and `more`
    tokens): a first prompt misses, its turn hits the first's `first` tokens whole. Prefilled in
    chunks of `chunk`; after(cache) once each has finished. The vmm tests of the prefix cache under
    a physical cap drive the stand-in and the GPU alike with it."""
    rng = np.random.default_rng(seed)
    prompt = None
    for i in range(requests):
        prompt = rng.integers(0, 1 << 30, first) if i % 2 == 0 else np.concatenate((prompt, rng.integers(0, 1 << 30, more)))
        n = len(prompt)
        assert cache.can_admit(n, 8, token_ids=prompt)
        adm = cache.admit(i, n, 8, token_ids=prompt)
        assert adm.cached_tokens == (0 if i % 2 == 0 else first), i
        for at in range(adm.cached_tokens, n, chunk):
            cache.extend(i, min(chunk, n - at))
        cache.finish(i, token_ids=prompt)
        after(cache)


def serve_shared_prompts(cache, steps: int, seed: int, state, on_admission, on_write_refused, after_step=None) -> None:
    """Up to 12 running requests, each a 512-token system prompt out of six and 64-1,099 tokens of
    its own, 1-59 tokens generated: half the steps try an admission (`can_admit` first, then
    `admit` whatever it said), then every running request writes a 256-token prefill chunk or a
    token. A write refused (PoolExhaustedError) ends its request, as an engine would preempt it.
    state(): a snapshot compared before and after each call. on_admission(rid, yes, refusal or
    None, changed): after each admission tried; on_write_refused(rid, refusal, changed); and
    after_step(step), if given."""
    from kvatlas import PoolExhaustedError

    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 1000, 512) for _ in range(6)]
    running: dict = {}
    for step in range(steps):
        if len(running) < 12 and rng.random() < 0.5:
            ids = np.concatenate([systems[rng.integers(6)], rng.integers(0, 1000, int(rng.integers(64, 1100)))])
            rid, yes, before = f"r{step}", cache.can_admit(len(ids), 64, token_ids=ids), state()
            try:
                adm = cache.admit(rid, len(ids), 64, token_ids=ids)
            except PoolExhaustedError as exc:
                on_admission(rid, yes, exc, state() != before)
            else:
                on_admission(rid, yes, None, state() != before)
                running[rid] = [ids, adm.cached_tokens, len(ids) + int(rng.integers(1, 60))]
        for rid in list(running):
            ids, done, end = running[rid]
            before = state()
            try:
                if done < len(ids):
                    n = min(256, len(ids) - done)
                    cache.extend(rid, n)
                else:
                    n = 1
                    cache.step([rid])
            except PoolExhaustedError as exc:
                on_write_refused(rid, exc, state() != before)
                cache.finish(rid)
                del running[rid]
                continue
            running[rid][1] = done + n
            if done + n >= end:
                cache.finish(rid, token_ids=np.concatenate([ids, rng.integers(0, 1000, end - len(ids))]))
                del running[rid]
        if after_step is not None:
            after_step(step)
