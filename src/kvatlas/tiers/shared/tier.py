"""SharedTier: one cache process's client of a shared store, off the serving path.

    tier = SharedTier(store, layout, deadline_s=0.5)
    tier.put([Entry(kind, page_key, boundary, parts)], release)   # returns at once
    got = tier.get([Entry(...)])        # waits at most the deadline; got.reasons: None = hit
    tier.exists([...])                  # a hint; None when the store is not asked
    tier.poll()                         # retire finished puts (release their parts)

Store calls run on two threads of the tier's own, one for reads and one for writes (so a backlog
of puts never delays a read); the serving thread only waits for a read, and never longer than
the deadline. A call that fails, or is not back by its deadline, opens the breaker (a missed
deadline at once: the store's thread is still stuck in the call), and while it is open (or
while the store has not opened yet: opening.OpeningStore) every read is a miss with reason
`tier_unavailable` and every put is skipped; it closes by itself
when a trial call succeeds after the cool-off. A read that missed its deadline may still land
later: `Got.landing` is its future, and the caller keeps the destination memory untouched until
it is done.

A value is [64-byte header | payload parts] (kvatlas.tiers.shared.values). With
`modeled_scale` > 0 the payload is not the bytes but zeros of 1/modeled_scale of their length
(at least 8 B): bookkeeping-only runs keep the real keys, headers, first-writer-wins and, scaled,
the store's memory pressure, and count the real payload sizes as moved.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import numpy as np

from ...errors import ConfigError
from .breaker import Breaker
from .counters import SHARED_SCHEMA_VERSION, SharedCounters, SharedSnapshot
from .inbox import Inbox, _timed, copy_payload, read_chunks
from .store import ABSENT, EXISTS, FAILED, GET_FAILED, STORED, WRONG_SIZE, StoreUnavailable
from .values import HEADER_BYTES, check, checksums, header, sealed

MAX_PUTS_IN_FLIGHT = 256
READ_CHUNK = 64     # values per store call of a read (a later chunk is read while one is checked)
SUM_THREADS = max(1, min(4, os.cpu_count() or 1))   # a read batch's checksums are cut this many ways


class _Landing:
    """Reads that went past their deadline (cancelled ones never start)."""

    def __init__(self, futures) -> None:
        self.futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self, timeout=None) -> None:
        for f in self.futures:
            if not f.cancelled():
                try:
                    f.result(timeout)
                except StoreUnavailable:
                    pass


@dataclass(frozen=True, slots=True)
class Entry:
    kind: str               # "page" | "checkpoint"
    page_key: int
    boundary_tokens: int    # the resume point's boundary; a page's depth × page tokens
    parts: tuple = ()       # payload parts (uint8 arrays) in value order; () with a modeled payload


@dataclass(frozen=True, slots=True)
class Got:
    reasons: list           # per entry: None (a hit) or the miss reason
    landing: object = None  # a read past its deadline still in flight: keep its destinations


class _PutJob:
    __slots__ = ("future", "issued", "entries", "headers", "release", "landed", "late")

    def __init__(self, future, entries, headers, release, landed) -> None:
        self.future, self.issued, self.entries = future, time.monotonic(), entries
        self.headers, self.release, self.landed, self.late = headers, release, landed, False


def _split(e: Entry, value) -> tuple:
    """A value read whole (into the inbox): its header and its payload's ranges, one per part."""
    cut = np.cumsum([HEADER_BYTES] + [p.nbytes for p in e.parts])
    return value[:HEADER_BYTES], [value[a:b] for a, b in zip(cut[:-1], cut[1:])]


class SharedTier:
    def __init__(self, store, layout, *, deadline_s: float = 0.5, breaker: Breaker | None = None,
                 modeled_scale: int = 0, writer: int = 0, policy: str = "finish", header_slots: int = 1024,
                 inbox: bool = False) -> None:
        """`inbox`: with a zero-copy store, read each value whole into a registered inbox, check it
        there and copy a hit's payload into its parts (kvatlas.tiers.shared.inbox), instead of
        reading it straight into its header slot and parts (the default: on CI's 2-core machine,
        idle, Mooncake's read into the host buffers ran as fast as its read of whole values, and
        the tier restored at 0.72-0.80 of the store's own get against 0.63-0.70 through the inbox;
        loaded, the inbox read better). Either way a batch's checksums are cut across
        SUM_THREADS threads."""
        if not (isinstance(deadline_s, (int, float)) and 0 < deadline_s <= 60):
            raise ConfigError("deadline_s", f"{deadline_s!r}", "give seconds in (0, 60], e.g. 0.5")
        self.store, self.layout, self.deadline_s = store, layout, float(deadline_s)
        self.breaker = breaker if breaker is not None else Breaker()
        self.modeled_scale, self.writer, self.policy = int(modeled_scale), writer, policy
        self.c = SharedCounters()
        self._headers = np.zeros((header_slots, HEADER_BYTES), np.uint8)
        self._free_headers = list(range(header_slots - 1, -1, -1))
        self._pads = {k: np.zeros(self._pad_bytes(k), np.uint8) for k in layout.payload_bytes} if modeled_scale else {}
        for a in (self._headers, *self._pads.values()):
            store.register(a)
        self._reads = ThreadPoolExecutor(1, thread_name_prefix="kvatlas-shared-read")
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="kvatlas-shared-write")
        self._sums = ThreadPoolExecutor(SUM_THREADS - 1, thread_name_prefix="kvatlas-shared-sum") \
            if SUM_THREADS > 1 else None
        self._puts: list[_PutJob] = []
        self._lock = threading.Lock()    # poll may run on a scrape's thread (snapshot) beside put's
        self._late_reads: list = []   # (future, header ids)
        staged = inbox and store.zero_copy and not modeled_scale
        self._inbox = Inbox(store, max(self.value_bytes(k) for k in layout.payload_bytes)) if staged else None
        self.hit_tokens = self.hit_requests = 0

    def _pad_bytes(self, kind: str) -> int:
        return max(8, -(-self.layout.payload_bytes[kind] // self.modeled_scale + 7) // 8 * 8)

    def value_bytes(self, kind: str) -> int:
        """Bytes one value takes in the store (header + payload, scaled when modeled)."""
        return HEADER_BYTES + (self._pad_bytes(kind) if self.modeled_scale else self.layout.payload_bytes[kind])

    def _parts(self, e: Entry) -> list:
        return [self._pads[e.kind]] if self.modeled_scale else list(e.parts)

    # ------------------------------------------------------------------ headers
    def _take_headers(self, n: int) -> list | None:
        if n > len(self._free_headers):
            return None
        return [self._free_headers.pop() for _ in range(n)]

    def _give_headers(self, ids) -> None:
        self._free_headers.extend(ids)

    # ------------------------------------------------------------------ reads
    def _reader_stuck(self) -> bool:
        self._retire_late_reads()
        return bool(self._late_reads)

    def _retire_late_reads(self) -> None:
        left = []
        for fut, ids in self._late_reads:
            if fut.done():
                self._give_headers(ids)
            else:
                left.append((fut, ids))
        self._late_reads = left

    def _unavailable(self, entries, op: str) -> bool:
        """True (and the misses counted) when the store is not to be asked now."""
        if self.store.ready and self.breaker.allow() and not self._reader_stuck():
            return False
        for e in entries:
            self.c.misses[e.kind]["tier_unavailable"] += 1
        return True

    def _end(self, end_s: float | None) -> float:
        return time.monotonic() + self.deadline_s if end_s is None else end_s

    def _call(self, op: str, pool, fn, *args, end_s: float | None = None):
        """(result, None) or (None, miss reason); the breaker and the counters see the outcome."""
        fut = pool.submit(_timed, fn, *args)
        try:
            result, secs = fut.result(timeout=max(self._end(end_s) - time.monotonic(), 0.0))
        except FutureTimeout:
            self.breaker.failure(at_once=True)
            self.c.errors[op] += 1
            return fut, "deadline"
        except StoreUnavailable:
            self.breaker.failure()
            self.c.errors[op] += 1
            return None, "tier_unavailable"
        self.c.op_count[op] += 1
        self.c.op_seconds[op] += secs
        return result, None

    def miss(self, kind: str, reason: str) -> None:
        self.c.misses[kind][reason] += 1

    def exists(self, entries, end_s: float | None = None) -> list[bool] | None:
        """Which entries the store says it holds (a hint); None when it was not asked or failed
        (one lookup, one miss: counted on the first entry, with the reason). `end_s` (monotonic
        seconds): the deadline, when the caller's lookup and read share one (a prefetch's do);
        by default now + deadline_s."""
        if not entries:
            return []
        if not self.store.ready or not self.breaker.allow() or self._reader_stuck():
            self.miss(entries[0].kind, "tier_unavailable")
            return None
        keys = [self.layout.key(e.kind, e.page_key) for e in entries]
        result, why = self._call("exists", self._reads, self.store.exists_many, keys, end_s=end_s)
        if why is not None:
            self.miss(entries[0].kind, why)
            if why == "deadline":
                self._late_reads.append((result, []))
            return None
        self.breaker.success()
        return result

    def get(self, entries, end_s: float | None = None) -> Got:
        """Read entries into their parts; a hit is a value of the expected size whose header
        and checksum hold. Waits at most until `end_s`, by default the deadline from now
        (kvatlas.tiers.shared.inbox: how)."""
        entries = list(entries)
        if not entries:
            return Got([])
        staged = self._inbox is not None
        ids = None if self._unavailable(entries, "get") else ([] if staged else self._take_headers(len(entries)))
        if ids is None:
            if len(entries) > len(self._free_headers):    # (not counted yet: no header slot free)
                for e in entries:
                    self.c.misses[e.kind]["tier_unavailable"] += 1
            return Got(["tier_unavailable"] * len(entries))
        keys = [self.layout.key(e.kind, e.page_key) for e in entries]
        sizes = [self.value_bytes(e.kind) for e in entries]
        if staged:
            spans, views = self._inbox.plan(sizes)
            dests_of = lambda k, a, b: [[v] for v in views(k, sizes[a:b])]  # noqa: E731
        else:
            spans = [(a, min(a + READ_CHUNK, len(entries))) for a in range(0, len(entries), READ_CHUNK)]
            dests_of = lambda k, a, b: [[self._headers[ids[i]]] + self._parts(entries[i]) for i in range(a, b)]  # noqa: E731
        reasons = []

        def judged(k, a, b, codes, secs):
            self.c.op_count["get"] += 1
            self.c.op_seconds["get"] += secs
            if staged:   # each value whole in the inbox: its header and payload ranges there
                read = [_split(entries[i], v) for i, v in zip(range(a, b), views(k, sizes[a:b]))]
            else:
                read = [(self._headers[ids[i]], self._parts(entries[i])) for i in range(a, b)]
            sums = self._digests(entries[a:b], codes, read)
            for j, (i, code) in enumerate(zip(range(a, b), codes)):
                why = self._judge(entries[i], code, *read[j], sums[j])
                if staged and why is None:   # a hit's payload, from the inbox into its parts
                    for dst, src in zip(entries[i].parts, read[j][1]):
                        copy_payload(dst, src)
                reasons.append(why)

        why, upto, late = read_chunks(self._reads, self.store.get_many, keys, dests_of, spans,
                                      self._end(end_s), judged)
        if why is not None:
            self.breaker.failure(at_once=why == "deadline")
            self.c.errors["get"] += 1
            for e in entries[upto:]:
                self.c.misses[e.kind][why] += 1
            reasons += [why] * (len(entries) - upto)
        elif any(r == "tier_unavailable" for r in reasons):
            self.breaker.failure()
        else:
            self.breaker.success()
        if late:     # reads still writing: into the inbox (then nothing of the caller's), or into the parts
            landing = _Landing(late)
            self._late_reads.append((landing, ids))
            return Got(reasons, landing=None if staged else landing)
        self._give_headers(ids)
        return Got(reasons)

    def _digests(self, entries, codes, read) -> list:
        """The checksums of the values read whole (`read`: per entry its header and payload
        ranges; the others are misses without one), made at once across the sum threads."""
        if self.modeled_scale:
            return [None] * len(entries)
        whole = [j for j, (e, c) in enumerate(zip(entries, codes)) if c == self.value_bytes(e.kind)]
        sums = checksums([read[j] for j in whole], self._sums, SUM_THREADS)
        out = [None] * len(entries)
        for j, d in zip(whole, sums):
            out[j] = d
        return out

    def _judge(self, e: Entry, code: int, raw_header, parts, digest: int | None = None) -> str | None:
        if code == ABSENT:
            why = "absent"
        elif code == WRONG_SIZE:
            why = "size_mismatch"
        elif code == GET_FAILED or code < 0:
            self.c.errors["get"] += 1
            why = "tier_unavailable"
        else:
            self.c.moved_bytes["from_store"] += HEADER_BYTES + self.layout.payload_bytes[e.kind]
            why = check(self.layout, e.kind, e.page_key, e.boundary_tokens, code, raw_header,
                        None if self.modeled_scale else parts, self.value_bytes(e.kind), digest)
        if why is None:
            self.c.hits[e.kind] += 1
            self.c.moved_entries[e.kind]["from_store"] += 1
        else:
            self.c.misses[e.kind][why] += 1
        return why

    # ------------------------------------------------------------------ writes
    def put(self, entries, release=None, landed=None) -> bool:
        """Queue entries for the store (first writer wins); `release()` is called (by poll) once
        the store no longer reads their parts, and `landed(entries, outcomes)` with what the store
        said of each (stored, exists, full or failed; poll may run on another thread than put's).
        False (released at once, `landed` never called) when skipped."""
        entries = list(entries)
        self.poll()
        ids = None
        if entries and self.store.ready and self.breaker.allow() and len(self._puts) < MAX_PUTS_IN_FLIGHT:
            ids = self._take_headers(len(entries))
        if ids is None:
            for e in entries:
                self.c.puts[e.kind]["skipped"] += 1
            if release is not None:
                release()
            return False
        fut = self._writes.submit(_timed, self._put_now, entries, ids)
        with self._lock:
            self._puts.append(_PutJob(fut, entries, ids, release, landed))
        return True

    def _put_now(self, entries, ids) -> list[str]:
        """On the write thread: skip what the store holds already, then put the rest."""
        keys = [self.layout.key(e.kind, e.page_key) for e in entries]
        have = self.store.exists_many(keys)
        todo = [i for i, h in enumerate(have) if not h]
        out = [EXISTS] * len(entries)
        if not todo:
            return out
        values = []
        for i in todo:
            e, h = entries[i], self._headers[ids[i]]
            parts = self._parts(e)
            head = header(self.layout, e.kind, e.page_key, e.boundary_tokens, self.layout.payload_bytes[e.kind], 0,
                          self.writer)
            h[:] = np.frombuffer(head if self.modeled_scale else sealed(head, parts), np.uint8)
            values.append([h] + parts)
        for i, o in zip(todo, self.store.put_many([keys[i] for i in todo], values)):
            out[i] = o
        return out

    def poll(self) -> int:
        """Retire finished puts; a put past its deadline counts once as an error and opens the
        breaker. Returns the puts still in flight."""
        with self._lock:
            return self._poll()

    def _poll(self) -> int:
        left, now = [], time.monotonic()
        for job in self._puts:
            if not job.future.done():
                if not job.late and now - job.issued > self.deadline_s * max(1, len(job.entries) / 16):
                    job.late = True
                    self.c.errors["put"] += 1
                    self.breaker.failure(at_once=True)
                left.append(job)
                continue
            self._retire_put(job)
        self._puts = left
        self._retire_late_reads()
        return len(left)

    def _retire_put(self, job: _PutJob) -> None:
        try:
            outcomes, secs = job.future.result()
        except StoreUnavailable:
            outcomes, secs = None, 0.0
        if outcomes is None:
            if not job.late:
                self.c.errors["put"] += 1
                self.breaker.failure()
            outcomes = [FAILED] * len(job.entries)
            for e in job.entries:
                self.c.puts[e.kind][FAILED] += 1
        else:
            self.c.op_count["put"] += 1
            self.c.op_seconds["put"] += secs
            if not job.late:
                self.breaker.success()
            for e, o in zip(job.entries, outcomes):
                self.c.puts[e.kind][o] += 1
                if o == STORED:
                    self.c.moved_entries[e.kind]["to_store"] += 1
                    self.c.moved_bytes["to_store"] += HEADER_BYTES + self.layout.payload_bytes[e.kind]
        self._give_headers(job.headers)
        if job.release is not None:
            job.release()
        if job.landed is not None:
            job.landed(job.entries, outcomes)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for the queued puts (benchmarks and tests; never on the serving path)."""
        for job in list(self._puts):
            try:
                job.future.result(timeout=timeout_s)
            except (FutureTimeout, StoreUnavailable):
                pass
        self.poll()

    # ------------------------------------------------------------------ reports
    def snapshot(self) -> SharedSnapshot:
        in_flight = self.poll() + len(self._late_reads)
        c = self.c
        copy = lambda d: {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}  # noqa: E731
        return SharedSnapshot(
            schema_version=SHARED_SCHEMA_VERSION, store=self.store.describe(), layout_tag=self.layout.tag,
            policy=self.policy, modeled_payload=bool(self.modeled_scale), deadline_s=self.deadline_s,
            # a store not open yet is bypassed as an open breaker is (the gauge and its alert see it)
            breaker_open=self.breaker.is_open or not self.store.ready,
            breaker_state=self.breaker.state if self.store.ready else "store_not_open",
            breaker_opened=self.breaker.times_opened, moved_bytes=copy(c.moved_bytes),
            moved_entries=copy(c.moved_entries), hits=copy(c.hits), misses=copy(c.misses), errors=copy(c.errors),
            op_count=copy(c.op_count), op_seconds=copy(c.op_seconds), puts=copy(c.puts),
            outbox_bytes=0, in_flight=in_flight, hit_tokens=self.hit_tokens, hit_requests=self.hit_requests)

    def close(self, timeout_s: float = 5.0) -> None:
        self.flush(timeout_s)
        self._reads.shutdown(wait=False, cancel_futures=True)
        self._writes.shutdown(wait=False, cancel_futures=True)
        if self._sums is not None:
            self._sums.shutdown(wait=False, cancel_futures=True)
        self.store.close()
