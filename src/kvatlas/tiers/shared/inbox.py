"""How a batch of values is read: in chunks, on the tier's read thread, while the caller's thread
checks the chunk before (the store's calls release the interpreter lock: measured, a read and a
checksum of the same size overlap).

By default every store reads into the parts themselves, a header slot first (four ranges a page:
its header and one per host buffer). With `SharedTier(inbox=True)` and a zero-copy store (Mooncake)
each value lands whole, as one range, in the inbox (registered memory, two chunks of up to 16
MiB), is checked there, and a hit's payload is copied into its parts; a read past its deadline
then writes only into the inbox, never into a caller's memory. Which is faster depends on the
machine: on CI's 2-core machine loaded, four ranges a value read 25-35% slower than one; idle,
as fast, and the copy then costs more than it saves (bench/RESULTS.md, issue 24)."""

from __future__ import annotations

import ctypes
import time
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from .store import StoreUnavailable

CHUNK_BYTES = 16 << 20    # one read call: a chunk of values up to this many bytes (one value at least)


def copy_payload(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src for a hit's payload range: memmove where both are contiguous bytes of one size
    (2.95 ms for a 20 MB batch against numpy's copyto 6.5-6.9 ms on CI's 2-core machine, measured
    from the inbox into the host tier's buffers), else numpy."""
    if (dst.nbytes == src.nbytes and dst.flags.c_contiguous and src.flags.c_contiguous
            and dst.dtype == src.dtype == np.uint8):
        ctypes.memmove(dst.ctypes.data, src.ctypes.data, dst.nbytes)
    else:
        np.copyto(dst, src)


def _timed(fn, *args):
    t = time.perf_counter()
    return fn(*args), time.perf_counter() - t


def spans_of(sizes, chunk_bytes: int) -> list[tuple[int, int]]:
    """Consecutive runs of values of at most chunk_bytes (a larger value alone)."""
    out, a, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > a and total + n > chunk_bytes:
            out.append((a, i))
            a, total = i, 0
        total += n
    if a < len(sizes):
        out.append((a, len(sizes)))
    return out


class Inbox:
    """Two halves of registered memory: chunk k lands in half k % 2, its values packed."""

    def __init__(self, store, value_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = max(chunk_bytes, value_bytes)
        self.buf = np.zeros((2, self.chunk_bytes), np.uint8)
        store.register(self.buf)

    def views(self, k: int, sizes) -> list:
        return _packed(self.buf[k % 2], sizes)

    def plan(self, sizes):
        """(spans, views(k, sizes of chunk k)): a batch that fits in both halves together is one
        read call into the whole inbox, checked once it has landed (Mooncake's batch read of 16
        pages and a resume point: 24.7 ms as one call, and the same two chunks read while the
        first was being checked took 34-39 ms on CI's 2-core machine, the checks and the store's
        transfer threads sharing the cores); a larger one goes in chunks, alternating halves."""
        if sum(sizes) <= self.buf.size:
            whole = self.buf.reshape(-1)
            return [(0, len(sizes))], lambda k, part: _packed(whole, part)
        return spans_of(sizes, self.chunk_bytes), self.views


def _packed(buf, sizes) -> list:
    cut = np.cumsum([0, *sizes]).tolist()
    return [buf[a:b] for a, b in zip(cut[:-1], cut[1:])]


def read_chunks(pool, get_many, keys, dests_of, spans, end_s: float, on_chunk):
    """Read the values chunk by chunk (`spans`), keeping at most two calls queued (two inbox
    halves); on_chunk(k, a, b, codes, seconds) after each lands. Returns (why, values read on,
    futures still running): why is None, "deadline" or "tier_unavailable"."""
    n = spans[-1][1] if spans else 0
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
        on_chunk(k, a, b, codes, secs)
        if k + 2 < len(spans):
            submit(k + 2)
    return None, n, []


def _late(futs: dict, first: int) -> list:
    for k, f in futs.items():
        if k >= first:
            f.cancel()      # queued ones never start
    return [f for f in futs.values() if not f.done()]
