"""One lifecycle call on a running request, chosen by (op, x): shared by the property tests of
the allocator and of the vmm backend, so both drive the cache the same way. And a run of
conversation turns one at a time (serve_turns), shared by the vmm tests on the stand-in and on
the GPU."""

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
