"""How a batch of values is read: in chunks, on the tier's read thread, while the caller's thread
checks the chunk before (the store's calls release the interpreter lock: measured, a read and a
checksum of the same size overlap).

With a zero-copy store (Mooncake) each value lands whole, as one range, in the inbox (registered
memory, two chunks deep): a value read straight into its host buffers is four ranges (its header
and one per host buffer) and the store moves each separately (25-35% slower than one range,
measured). The caller checks it there and copies the payload of a hit into its parts; a read past
its deadline writes only into the inbox, never into a caller's memory. Other stores (and
modeled payloads) read into the parts themselves, a header slot first."""

from __future__ import annotations

import time
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from .store import StoreUnavailable

CHUNK = 4


def _timed(fn, *args):
    t = time.perf_counter()
    return fn(*args), time.perf_counter() - t


class Inbox:
    def __init__(self, store, value_bytes: int, chunk: int = CHUNK) -> None:
        self.chunk = chunk
        self.buf = np.zeros((2, chunk, -(-value_bytes // 64) * 64), np.uint8)
        store.register(self.buf)

    def view(self, k: int, j: int, nbytes: int):
        return self.buf[k % 2, j, :nbytes]


def read_chunks(pool, get_many, keys, dests_of, n: int, chunk: int, end_s: float, on_chunk, inbox=None):
    """Read n values, `chunk` per call, keeping at most two calls queued (two inbox buffers);
    on_chunk(a, b, codes, seconds) after each lands. Returns (why, futures still running): why
    is None, "deadline" or "tier_unavailable" (the values from the first chunk not read on)."""
    spans = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
    futs: dict = {}

    def submit(k):
        a, b = spans[k]
        futs[k] = pool.submit(_timed, get_many, keys[a:b], dests_of(k, a, b))

    for k in range(min(2, len(spans))):
        submit(k)
    for k, (a, b) in enumerate(spans):
        try:
            codes, secs = futs[k].result(timeout=max(end_s - time.monotonic(), 0.0))
        except FutureTimeout:
            return "deadline", a, _late(futs, k)
        except StoreUnavailable:
            return "tier_unavailable", a, _late(futs, k + 1)
        on_chunk(a, b, codes, secs)
        if k + 2 < len(spans):
            submit(k + 2)
    return None, n, []


def _late(futs: dict, first: int) -> list:
    for k, f in futs.items():
        if k >= first:
            f.cancel()      # queued ones never start
    return [f for f in futs.values() if not f.done()]
