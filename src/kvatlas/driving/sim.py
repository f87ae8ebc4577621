"""The driver: a small continuous-batching scheduler that runs a workload through a KVCache.

Each `step(now_s)` is one forward pass, the way an engine's scheduler loop makes it:
1. requests whose arrival time has come join the waiting queue (FIFO);
2. admission by `cache.can_admit` (exact: slots and full pages), in order, of the requests this
   pass can start prefilling, as engines admit (SGLang's prefill adder, vLLM's scheduler): while
   the pass's token budget, after the decode batch and the prompts already prefilling, has room.
   A request waiting in the queue holds no memory; one admitted early would hold its reserved
   pages through passes that cannot reach it, evicting the prefix cache to get them. A request
   longer than max_model_len can never run and is rejected, not retried. Cache-aware admission
   (`hold_for_writers=N`): a waiting request whose next pages past its cached prefix running
   requests are still writing (pages shared as written) is passed over, for N passes at most,
   the requests behind it admitted meanwhile: admitted a few passes later it hits those pages
   instead of computing them again. It keeps its place at the head of the queue. Prefix-first
   admission (`admission_window=W`, as vLLM 0.34's `cache_aware_admission_window`): before each
   pass's admissions, the first W waiting requests are ordered by the pages of their prompt the
   prefix cache holds, deepest first (arrival order breaking ties), so a request whose prefix is
   resident starts before a cold one's pages evict it. Queue-aware eviction
   (`queue_aware_eviction`, on by default): each arriving request is enqueued with the prefix
   cache (`PrefixCache.enqueue`), so eviction keeps the pages waiting requests will hit while
   others remain, and of those takes the ones whose first reader waits furthest back first;
3. one forward pass (`allocator.forward()`): decode first — every decoding request writes
   1 + draft tokens (capped by what it still has to generate) — then chunked prefill with what
   is left of the `chunked_prefill_tokens` budget, which bounds ALL new tokens of the pass
   (the plan sizes the SWA in flight on that bound, SPEC §3);
4. drafts are accepted left to right with probability `accept_rate` each; the rejected tail is
   rolled back;
5. finished requests are released; a ledger snapshot is recorded on the timeline.

The driver holds `lock` while it mutates the cache, so a scrape in another thread never sees a
half-done step. Time is the caller's: `run_offline` advances a virtual clock by each pass's
duration under the time model (`driving.timemodel`), `kvatlas serve` passes the wall clock and
paces itself by the same durations.

Sessions: a request with `after` set (the next turn of a conversation) is held until the request
it follows finishes (or is rejected), then arrives `think_s` later (not before its own arrival_s).

A bookkeeping cache (backend "none") runs the same code; only the writer is absent. Each pass
reads the ledger's occupied counter for the peaks; the full snapshot for the timeline is taken at
most once per `sample_s` of time (0: every pass), because a snapshot walks every pool.

`check_integrity` (debug): after every pass the counters that must agree are compared (the
ledger's units and running requests against the allocator's free lists and slot table, the prefix
cache's queried = hit + missed), O(1) each; the whole recount of every book (allocator, ledger,
prefix cache, host tier; O(pool units)) runs after the first pass, at the end, and in between as
often as `integrity_share` allows: while the recounts' CPU time is at most that share of the
passes' own, so the run costs at most (1 + share)x its CPU, plus one recount. A recount that finds
a book broken names its pass and the last pass the books were whole after;
`integrity_share=None` recounts after every pass (to pin a break to its pass).
"""

from __future__ import annotations

import contextlib
import heapq
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..checks import real, whole
from ..errors import ConfigError
from .latency import LatencyLog
from .limits import LimitLog
from .timemodel import TimeModel


def _sequence(req):
    """Prompt and output token ids (None when the request carries no content)."""
    prompt = req.token_ids()
    out = req.output_token_ids()
    if prompt is None or out is None:
        return prompt
    return np.concatenate((prompt, out))


@dataclass(slots=True)
class _Live:
    req: object
    prefilled: int = 0
    generated: int = 0
    ready_s: float = 0.0     # its host-tier restores land then: no forward pass before

    @property
    def decoding(self) -> bool:
        return self.prefilled >= self.req.prompt_tokens


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    t_s: float
    step: int
    running: int
    waiting: int
    finished: int
    snapshot: object
    prefix_queried_tokens: int = 0   # prefix cache counters so far (0 without one)
    prefix_hit_tokens: int = 0


@dataclass(slots=True)
class SimStats:
    arrived: int = 0
    admitted: int = 0
    finished: int = 0
    rejected_too_long: int = 0
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    drafts_accepted: int = 0
    drafts_rejected: int = 0
    blocked_steps: int = 0          # passes where the head of the queue could not be admitted
    held_passes: int = 0            # times a waiting request was passed over for a writer (hold_for_writers)
    reordered_passes: int = 0       # passes whose waiting head prefix-first admission reordered (admission_window)
    peak_running: int = 0
    peak_occupied_bytes: int = 0
    rejected_ids: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__ if k != "rejected_ids"}


def _split_sessions(requests) -> tuple[list, dict]:
    """(open-loop requests, {id: [requests that follow it]}); refuses repeated ids and links to
    requests not given before (which would hold a turn back forever)."""
    seen, free, followers = set(), [], {}
    for r in requests:
        if r.id in seen:
            raise ConfigError("requests", f"id {r.id!r} appears twice", "give each request its own id")
        if r.after is not None:
            if r.after not in seen:
                raise ConfigError("requests", f"{r.id!r} follows {r.after!r}, which is not an earlier request",
                                  "list a session's turns in order")
            followers.setdefault(r.after, []).append(r)
        else:
            free.append(r)
        seen.add(r.id)
    return free, followers


_REQUEST_FIELDS = ("id", "arrival_s", "prompt_tokens", "output_tokens")
# check_integrity's whole recounts may take this much CPU per CPU second of the passes (module doc)
INTEGRITY_SHARE = 1.0
# cache-aware admission (module doc): the most passes a waiting request is passed over for writers
HOLD_FOR_WRITERS = 4
# prefix-first admission (module doc): waiting requests at the head of the queue ordered by cached prefix
ADMISSION_WINDOW = 0


def _check_args(cache, requests, *, accept_rate, seed, writer, step_s, record, time_model, sample_s, host,
                check_integrity, queue_aware_eviction) -> list:
    """Every constructor argument checked before anything is built (a KvatlasError naming it);
    the requests as a list."""
    from ..cache.kvcache import KVCache
    if not isinstance(cache, KVCache):
        raise ConfigError("cache", f"{type(cache).__name__} is not a kvatlas cache", "give kvatlas.allocate(plan)")
    if requests is None or isinstance(requests, (str, bytes, dict)) or not hasattr(requests, "__iter__"):
        raise ConfigError("requests", f"{type(requests).__name__} is not a list of requests",
                          "give kvatlas.driving.workload.Request objects (synthetic(), read_trace())")
    requests = list(requests)
    bad = [r for r in requests if not all(hasattr(r, a) for a in _REQUEST_FIELDS)][:1]   # None is a bad one too
    if bad:
        raise ConfigError("requests", f"{bad[0]!r:.40} is not a request",
                          "give kvatlas.driving.workload.Request objects (synthetic(), read_trace())")
    real("accept_rate", accept_rate, 0.0, 1.0)
    real("step_s", step_s, 0.0, 3600.0, open_low=True)
    whole("seed", seed, 0, 2**63 - 1)
    real("sample_s", sample_s, 0.0, 1e12)
    for name, flag in (("record", record), ("check_integrity", check_integrity),
                       ("queue_aware_eviction", queue_aware_eviction)):
        if not isinstance(flag, bool):
            raise ConfigError(name, f"{flag!r} is not True or False", "give a bool")
    if time_model is not None and not isinstance(time_model, TimeModel):
        raise ConfigError("time_model", f"{type(time_model).__name__} is not a TimeModel",
                          "give kvatlas.driving.timemodel.TimeModel(...) or None")
    from .simwrite import KVWriter
    if writer is not None and not isinstance(writer, KVWriter):
        raise ConfigError("writer", f"{type(writer).__name__} is not a KVWriter", "give KVWriter(cache) or None")
    if host is not None:
        from ..tiers import HostLink
        if not isinstance(host, HostLink) or host.prefix is not cache.prefix:
            raise ConfigError("host", f"{type(host).__name__} is not a host tier under this cache's prefix cache",
                              "pass cache.host after kvatlas.tiers.attach_host_tier(cache, ...), or None")
    return requests


class Simulator:
    def __init__(self, cache, requests, *, accept_rate: float = 0.7, seed: int = 0, writer=None, lock=None,
                 step_s: float = 0.02, record: bool = True, time_model: TimeModel | None = None,
                 sample_s: float = 0.0, host=None, check_integrity: bool = False,
                 integrity_share: float | None = INTEGRITY_SHARE, hold_for_writers: int = HOLD_FOR_WRITERS,
                 admission_window: int = ADMISSION_WINDOW, queue_aware_eviction: bool = True) -> None:
        requests = _check_args(cache, requests, accept_rate=accept_rate, seed=seed, writer=writer, step_s=step_s,
                               record=record, time_model=time_model, sample_s=sample_s, host=host,
                               check_integrity=check_integrity, queue_aware_eviction=queue_aware_eviction)
        if integrity_share is not None:
            real("integrity_share", integrity_share, 0.0, 1e6, open_low=True)
        whole("hold_for_writers", hold_for_writers, 0, 1 << 20)
        whole("admission_window", admission_window, 0, 1 << 20)
        self.cache = cache
        # cache-aware admission (module doc): passes a waiting request may be passed over while
        # running requests write the pages right past its cached prefix (0: first come, first served)
        self.hold_for_writers = hold_for_writers if cache.prefix is not None else 0
        self._held: dict = {}     # request id -> passes it was passed over so far
        # prefix-first admission (module doc): how many waiting requests are ordered by cached prefix
        self.admission_window = admission_window if cache.prefix is not None else 0
        # queue-aware eviction (module doc): the prefix cache knows the waiting requests
        self.queue_aware_eviction = queue_aware_eviction and cache.prefix is not None
        # debug mode: counters compared after every pass, every book recounted paced by CPU (module doc)
        self.check_integrity = check_integrity
        self.integrity_share = integrity_share
        self.integrity_recounts = 0      # whole recounts done
        self._whole_after = -1           # the last pass after which a recount found every book whole
        self._run_cpu_s = self._check_cpu_s = 0.0
        # the host tier under the prefix cache (a tiers.HostLink), and its copy stream's clock:
        # moves run one after another on it, each for its modeled seconds (tiers.modeled)
        self.host = host
        self.host_clock = HostClock()
        free, self._followers = _split_sessions(requests)
        self.pending = deque(sorted(free, key=lambda r: r.arrival_s))
        self._released: list = []      # heap of (arrival_s, order, request): turns whose predecessor ended
        self._order = 0
        self.waiting: deque = deque()
        # running = prefilling + decoding, each in admission order; the split spares every pass a
        # scan of all running requests (256 of them, thousands of passes)
        self.running: dict[str, _Live] = {}
        self._prefilling: dict[str, _Live] = {}
        self._keys: dict = {}      # waiting request id -> its PromptKeys, hashed once however long it waits
        self._decoding: dict[str, _Live] = {}
        self._finishing: list = []
        self.draft_tokens = cache.plan.options.draft_tokens
        self.chunk = cache.plan.options.chunked_prefill_tokens
        self.max_len = cache.plan.options.max_model_len
        self.max_running = cache.plan.options.max_running_requests
        self.accept_rate = accept_rate
        self.rng = np.random.default_rng(seed)
        self.writer = writer
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.time_model = time_model if time_model is not None else TimeModel(pass_s=step_s)
        self.step_s = self.time_model.pass_s
        self.last_pass_s = self.time_model.pass_s   # duration of the latest pass under the time model
        self.record = record
        self.sample_s = sample_s
        self._next_sample_s = float("-inf")
        self.stats = SimStats()
        self.timeline: list[TimelinePoint] = []
        self._rr = 0   # round-robin start of the decode batch when it exceeds the token budget
        self.clock_s = 0.0   # run_offline: virtual time when the run ended
        self.now_s = 0.0     # the time of the pass in progress, or of the last one
        # per-request latency and the limits passes waited on (driving.latency, driving.limits)
        self.latency = LatencyLog()
        self.limits = LimitLog()

    @property
    def done(self) -> bool:
        return not (self.pending or self._released or self.waiting or self.running or self._followers)

    @property
    def next_arrival_s(self) -> float | None:
        heads = [self.pending[0].arrival_s] if self.pending else []
        if self._released:
            heads.append(self._released[0][0])
        return min(heads) if heads else None

    # ------------------------------------------------------------------ one pass
    def step(self, now_s: float) -> None:
        real("now_s", now_s, 0.0, 1e12)
        cpu0 = time.process_time() if self.check_integrity else 0.0
        self._arrive(now_s)
        with self.lock:
            self._admit(now_s, self._prefill_room(now_s))
            blocked = self._restoring_until(now_s)
            if self.running and blocked is None:
                with self.cache.allocator.forward():
                    decoded = self._decode(self.chunk)
                    prefilled = self._prefill(self.chunk - decoded, now_s)
                self._finish_done(now_s)
                self.stats.steps += 1
                self.last_pass_s = self.time_model.pass_time_s(prefilled, decoded)
                self.limits.pass_done(decoded + prefilled, self.chunk, now_s, self.last_pass_s, self.time_model.pass_s)
            else:   # idle, or every running request waits for its restores: no pass until they land
                self.cache.flush()
                self.last_pass_s = self.time_model.pass_s if blocked is None else min(self.time_model.pass_s,
                                                                                      blocked - now_s)
            if self.host is not None:
                self.host_clock.charge_offloads(self.host, now_s)
            if self.check_integrity:
                self._paced_check(now_s, cpu0)
            occupied = self.cache.ledger.occupied_bytes()
            snap = self.cache.ledger.snapshot() if self._sampling(now_s) else None
        self.latency.pass_ended(now_s + self.last_pass_s)
        self._observe(now_s, occupied, snap)

    def _paced_check(self, now_s: float, cpu0: float) -> None:
        """The counters after every pass; the whole recount while its CPU share allows (module doc)."""
        cpu1 = time.process_time()
        self._run_cpu_s += cpu1 - cpu0
        self._check(now_s, whole=False)
        if self.integrity_share is None or self._check_cpu_s <= self.integrity_share * self._run_cpu_s:
            self._check(now_s)
            self._check_cpu_s += time.process_time() - cpu1

    def _check(self, now_s: float, whole: bool = True) -> None:
        """Compare the counters (whole=False) or recount every book; an IntegrityError names the pass
        it was found after and the last pass a recount found every book whole after."""
        from ..alloc.integrity import counter_problems
        from ..errors import IntegrityError
        try:
            pc = self.cache.prefix
            if pc is not None and pc.stats.queried_tokens != pc.stats.hit_tokens + sum(pc.stats.missed().values()):
                raise IntegrityError(f"prefix stats: {pc.stats.queried_tokens} queried tokens != "
                                     f"{pc.stats.hit_tokens} hit + {sum(pc.stats.missed().values())} missed")
            if not whole:
                problems = counter_problems(self.cache.allocator, self.cache.ledger)
                if problems:
                    raise IntegrityError("cache counters disagree: " + "; ".join(problems))
                return
            self.cache.check_integrity()
            if self.host is not None:
                self.host.tier.check_integrity()
        except IntegrityError as exc:
            since = ("" if self._whole_after in (-1, self.stats.steps - 1) or self.integrity_share is None else
                     f"; every book was whole after pass {self._whole_after} (integrity_share=None recounts after "
                     "every pass, to find the one)")
            raise IntegrityError(f"after pass {self.stats.steps} (t = {now_s:.3f} s): {exc}{since}") from exc
        self.integrity_recounts += 1
        self._whole_after = self.stats.steps

    def _restoring_until(self, now_s: float) -> float | None:
        """When nothing running can take a pass before its restores land: the first landing."""
        if self.host is None or not self.running or self._decoding:
            return None
        first = min(x.ready_s for x in self._prefilling.values())
        return first if first > now_s else None

    def _arrive(self, now_s: float) -> None:
        """The requests arrived by now join the queue, each at its arrival time: while it joins,
        `now_s` reads that time (a recorder enqueued with it sees when it arrived, not the pass),
        and the pass's time after (what reads the clock during the pass: a recorder)."""
        while self.pending and self.pending[0].arrival_s <= now_s:
            r = self.pending.popleft()
            self.now_s = r.arrival_s
            self._queue(r, r.arrival_s)
        while self._released and self._released[0][0] <= now_s:
            t, _, r = heapq.heappop(self._released)
            self.now_s = t
            self._queue(r, t)
        self.now_s = now_s

    def _queue(self, r, t: float) -> None:
        """The request joins the waiting queue at time t."""
        self.waiting.append(r)
        self.latency.arrived(r, t)
        self.stats.arrived += 1
        if self.queue_aware_eviction:
            keys = self._prompt_keys(r)
            if keys is not None:
                self.cache.prefix.enqueue(r.id, r.prompt_tokens, page_keys=keys)

    def _release_followers(self, rid, now_s: float) -> None:
        for r in self._followers.pop(rid, ()):
            self._order += 1
            heapq.heappush(self._released, (max(r.arrival_s, now_s + r.think_s), self._order, r))

    def _sampling(self, now_s: float) -> bool:
        if not self.record or now_s < self._next_sample_s:
            return False
        self._next_sample_s = now_s + self.sample_s
        return True

    def _prefill_room(self, now_s: float) -> int:
        """Prompt tokens this pass can still take for requests not yet admitted: the token budget
        less the decode batch's tokens and the prompts already prefilling (those whose restores
        land later cannot take tokens this pass)."""
        room = self.chunk - min(self.chunk, sum(min(1 + self.draft_tokens, x.req.output_tokens - x.generated)
                                                for x in self._decoding.values()))
        for x in self._prefilling.values():
            if room <= 0:
                break
            if x.ready_s <= now_s:
                room -= x.req.prompt_tokens - x.prefilled
        return room

    def _prompt_keys(self, r):
        """A waiting request's page keys, hashed once however many passes it waits."""
        if self.cache.prefix is None:
            return None
        if r.id not in self._keys:
            ids = r.token_ids()   # (None: a request without content, never hits)
            self._keys[r.id] = None if ids is None else self.cache.prefix.prompt_keys(ids, r.prompt_tokens)
        return self._keys[r.id]

    def _hold(self, r, keys) -> bool:
        """Pass the request over this pass: running requests are writing the pages right past
        its cached prefix, and it has been passed over fewer than hold_for_writers passes."""
        held = self._held.get(r.id, 0)
        if held >= self.hold_for_writers or keys is None \
                or not self.cache.prefix.writing_next(r.prompt_tokens, page_keys=keys):
            return False
        self._held[r.id] = held + 1
        self.stats.held_passes += 1
        return True

    def _prefix_first(self) -> None:
        """Prefix-first admission (module doc): the first admission_window waiting requests,
        deepest cached prefix first, arrival order breaking ties."""
        head = [self.waiting.popleft() for _ in range(min(self.admission_window, len(self.waiting)))]
        depth = []
        for i, r in enumerate(head):
            keys = self._prompt_keys(r)
            depth.append((0 if keys is None else -self.cache.prefix.cached_pages(r.prompt_tokens, page_keys=keys), i))
        depth.sort()
        if any(i != j for j, (_, i) in enumerate(depth)):
            self.stats.reordered_passes += 1
        self.waiting.extendleft(head[i] for _, i in reversed(depth))

    def _admit(self, now_s: float, room: int) -> None:
        if self.admission_window and len(self.waiting) > 1:
            self._prefix_first()
        held: list = []
        try:
            self._admit_from_queue(now_s, room, held)
        finally:   # the requests passed over keep their places at the head of the queue
            self.waiting.extendleft(reversed(held))

    def _admit_from_queue(self, now_s: float, room: int, held: list) -> None:
        while self.waiting and room > 0:
            r = self.waiting[0]
            if r.prompt_tokens + r.output_tokens > self.max_len:
                self.waiting.popleft()
                self.stats.rejected_too_long += 1
                self.stats.rejected_ids.append(r.id)
                self.latency.rejected(r)
                self._release_followers(r.id, now_s)
                self._keys.pop(r.id, None)   # (hashed by prefix-first admission while it waited)
                if self.queue_aware_eviction:
                    self.cache.prefix.dequeue(r.id)
                continue
            keys = self._prompt_keys(r)
            if self.hold_for_writers and self._hold(r, keys):
                held.append(self.waiting.popleft())
                continue
            if self.host is not None and len(self.running) < self.max_running:   # not before it has a slot:
                self.host_clock.prefetch(self.host, r, keys, now_s)   # restored pages would be evicted again
            if not self.cache.can_admit(r.prompt_tokens, r.output_tokens, page_keys=keys):
                self.stats.blocked_steps += 1
                self.limits.blocked(self.cache, len(self.running), self.max_running)
                return
            self.waiting.popleft()
            self._keys.pop(r.id, None)
            self._held.pop(r.id, None)
            adm = self.cache.admit(r.id, r.prompt_tokens, r.output_tokens, page_keys=keys)
            live = _Live(r, prefilled=adm.cached_tokens,   # the cached prompt is not computed again
                         ready_s=self.host_clock.admitted(r.id, now_s) if self.host is not None else 0.0)
            self.running[r.id] = self._prefilling[r.id] = live
            self.stats.admitted += 1
            self.latency.admitted(r, now_s, adm.cached_tokens)
            if live.ready_s <= now_s:
                room -= r.prompt_tokens - adm.cached_tokens

    def _decode(self, budget: int) -> int:
        live = list(self._decoding.values())
        if not live:
            return 0
        start = self._rr % len(live)
        live = live[start:] + live[:start]
        want = np.array([min(1 + self.draft_tokens, x.req.output_tokens - x.generated) for x in live], np.int64)
        take = int(np.searchsorted(np.cumsum(want), budget, side="right"))
        if take == 0:
            return 0
        live, want = live[:take], want[:take]
        self._rr += take
        idx = self.cache.step([x.req.id for x in live], want)
        if self.writer is not None:
            self.writer.write(idx)
        accepted = self._accept(want - 1)
        for x, w, a in zip(live, want, accepted):
            if w - 1 > a:
                self.cache.rollback(x.req.id, int(w - 1 - a))
            self.latency.decoded(x.req, x.generated, x.generated + 1 + int(a))
            x.generated += 1 + int(a)
            if x.generated >= x.req.output_tokens:
                self._finishing.append(x.req.id)
        self.stats.decode_tokens += int(want.sum())
        self.stats.drafts_accepted += int(accepted.sum())
        self.stats.drafts_rejected += int((want - 1 - accepted).sum())
        return int(want.sum())

    def _accept(self, drafts: np.ndarray) -> np.ndarray:
        """Accepted drafts per request: leading successes of Bernoulli(accept_rate) trials."""
        d = int(drafts.max(initial=0))
        if d == 0:
            return np.zeros(len(drafts), np.int64)
        ok = self.rng.random((len(drafts), d)) < self.accept_rate
        return np.minimum(np.cumprod(ok, axis=1).sum(axis=1), drafts)

    def _prefill(self, budget: int, now_s: float = 0.0) -> int:
        """Prompt tokens written this pass (at most budget)."""
        done, complete = 0, []
        for x in self._prefilling.values():
            if budget <= done:
                break
            if x.ready_s > now_s:   # its host-tier restores are still in flight
                continue
            if self.host is not None:
                self.host_clock.first_pass(x.req.id, now_s)
            n = min(x.req.prompt_tokens - x.prefilled, budget - done)
            idx = self.cache.extend(x.req.id, n)
            if self.writer is not None:
                self.writer.write(idx)
            x.prefilled += n
            done += n
            if x.decoding:
                complete.append(x)
        for x in complete:   # decoding from the next pass on, in the order their prompts completed
            self.latency.prefilled(x.req)
            del self._prefilling[x.req.id]
            self._decoding[x.req.id] = x
        self.stats.prefill_tokens += done
        return done

    def _finish_done(self, now_s: float) -> None:
        for rid in self._finishing:
            if self.cache.prefix is not None:   # the whole sequence keys the pages it leaves cached
                self.cache.finish(rid, token_ids=_sequence(self.running[rid].req))
            else:
                self.cache.finish(rid)
            del self.running[rid], self._decoding[rid]
            self.stats.finished += 1
            self._release_followers(rid, now_s)
        self._finishing.clear()

    def _observe(self, now_s: float, occupied: int, snap) -> None:
        s = self.stats
        s.peak_running = max(s.peak_running, self.cache.ledger.running_requests)
        s.peak_occupied_bytes = max(s.peak_occupied_bytes, occupied)
        if snap is not None:
            pc = self.cache.prefix.stats if self.cache.prefix is not None else None
            self.timeline.append(TimelinePoint(now_s, s.steps, len(self.running), len(self.waiting), s.finished, snap,
                                               pc.queried_tokens if pc else 0, pc.hit_tokens if pc else 0))

    # ------------------------------------------------------------------ drivers
    def run_offline(self, max_steps: int | None = None, on_step=None) -> SimStats:
        """As fast as possible on a virtual clock: each pass takes step_s; idle time is skipped.
        `on_step(simulator)`, if given, is called after every pass (the CLI's progress bar)."""
        if max_steps is not None:
            whole("max_steps", max_steps, 1)
        if on_step is not None and not callable(on_step):
            raise ConfigError("on_step", f"{type(on_step).__name__} is not callable", "give a function of the simulator, or None")
        t = 0.0
        steps = 0
        while not self.done and (max_steps is None or steps < max_steps):
            if not (self.waiting or self.running) and self.next_arrival_s is not None:
                t = max(t, self.next_arrival_s)
            self.step(t)
            t += self.last_pass_s
            steps += 1
            if on_step is not None:
                on_step(self)
        with self.lock:
            self.cache.flush()
            if self.check_integrity:   # the end state always recounted whole
                self._check(t)
            if self.record and (not self.timeline or self.timeline[-1].step != self.stats.steps):
                self._next_sample_s = float("-inf")   # the end state is always on the timeline
                self._observe(t, self.cache.ledger.occupied_bytes(), self.cache.ledger.snapshot())
        self.clock_s = t
        return self.stats

    def unarrived(self) -> list:
        """Requests whose arrival has not come (a session's turns not yet released too)."""
        return [*self.pending, *(r for _, _, r in self._released), *(r for v in self._followers.values() for r in v)]

    def progress(self) -> dict:
        """Per running request: its lengths and progress. Takes no lock: a scrape calls it under
        the lock it already holds, beside the ledger snapshot, so both describe the same pass."""
        return {rid: {"prompt_tokens": x.req.prompt_tokens, "output_tokens": x.req.output_tokens,
                      "prefilled_tokens": x.prefilled, "generated_tokens": x.generated}
                for rid, x in self.running.items()}

    def request_usage(self) -> dict:
        """Per running request: its progress and its bytes by pool (for /state)."""
        with self.lock:
            return {rid: {"prompt_tokens": x.req.prompt_tokens, "output_tokens": x.req.output_tokens,
                          "prefilled_tokens": x.prefilled, "generated_tokens": x.generated,
                          "pools": self.cache.request_usage(rid)} for rid, x in self.running.items()}

    def state(self) -> dict:
        return {"stats": self.stats.as_dict(), "running": len(self.running), "waiting": len(self.waiting),
                "pending": len(self.pending) + len(self._released) + sum(map(len, self._followers.values())),
                "done": self.done, "draft_tokens": self.draft_tokens,
                "accept_rate": self.accept_rate,
                "prefix": self.cache.prefix.stats.as_dict() if self.cache.prefix is not None else None}


class HostClock:
    """The host tier's copy stream on the simulator's clock. Every move takes its modeled seconds
    (`Transfer.modeled_s`: bytes at the measured H200 bandwidth plus a cost per copy call), one
    after another. Offloads (device to host, at eviction) only occupy the stream: the device
    units they free are reused at once, as the allocator sees it, and a pass never waits for
    them; a restore queued behind them waits, and the request that restores waits for its
    restores to land before its first forward pass."""

    def __init__(self) -> None:
        self.free_s = 0.0          # when the copy stream is next idle
        self.charged_host_s = 0.0  # offload seconds already on the stream
        self.restore_s = 0.0       # restore seconds, summed
        self.wait_s = 0.0          # admission to first pass of restoring requests, summed
        self.restoring = 0         # requests that waited for a restore
        self._ready: dict = {}     # request id -> its restores' times, until its first pass
        # request id -> (restores issued at, admitted at, queued behind earlier moves, restore
        # seconds, first pass at): issued before admission when memory held the request back
        self.first_passes: dict = {}

    def charge_offloads(self, link, now_s: float) -> None:
        new = link.tier.modeled_seconds["host"] - self.charged_host_s
        if new > 0:
            self.free_s = max(self.free_s, now_s) + new
            self.charged_host_s += new

    def prefetch(self, link, req, keys, now_s: float) -> None:
        ready = link.prefetch(req.prompt_tokens, page_keys=keys)
        self.charge_offloads(link, now_s)    # room made on the device goes first on the stream
        if ready is None:
            return
        start = max(self.free_s, now_s)
        self.free_s = start + ready.modeled_s
        w = self._ready.setdefault(req.id, {"queued_s": 0.0, "restore_s": 0.0, "issued_s": now_s})
        w["queued_s"] += start - now_s
        w["restore_s"] += ready.modeled_s
        w["ready_s"] = self.free_s
        self.restore_s += ready.modeled_s

    def admitted(self, rid, now_s: float) -> float:
        """When this request's restores land (0: it has none)."""
        w = self._ready.get(rid)
        if w is None:
            return 0.0
        w["admitted_s"] = now_s
        return w["ready_s"]

    def first_pass(self, rid, now_s: float) -> None:
        w = self._ready.pop(rid, None)
        if w is not None:
            self.first_passes[rid] = (w["issued_s"], w["admitted_s"], w["queued_s"], w["restore_s"], now_s)
            self.wait_s += now_s - w["admitted_s"]
            self.restoring += 1
