"""Which limit held a run back, and the flag that moves it.

Each scheduler pass the simulator says whether the head of the queue waited, and for what:
- a request slot: every one of max_running_requests slots was taken;
- memory: a slot was free but the full-token pages (after evicting what the prefix cache may
  evict) could not hold the request's prompt + output;
and how much of the chunk budget (chunked_prefill_tokens, which bounds every new token of a
pass) the pass used. "Memory committed" is the share of full-token pages that an admission
could not have: held or reserved by running requests, and cached pages they read.

The verdict first reads the modelled GPU's busy time (every forward pass's time under the time
model, against the span from the first pass to the last): when the passes ran back to back and
the fixed per-pass cost (the only time more slots or a larger chunk can save: they put more
tokens in a pass, and each token costs its time whatever the batch) is a small share of them, the
per-token work bound the run, and no flag of the plan would finish it sooner — requests queued
for compute, not for a slot or memory. Otherwise it names the limit that made the most passes
wait, with the figures behind it, and the flag that moves it; with no wait at all it says
whether the chunk budget or the arrivals bound the run. What each flag costs is stated from the
plan (a slot's fixed bytes, in tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..units import fmt_bytes

# a pass that used this share of the chunk budget or more counts as full; the budget binds when
# more than half the passes are full
CHUNK_BOUND_SHARE = 0.5
# the GPU bound the run when its passes filled this share of their span and the fixed per-pass
# cost was at most FIXED_SHARE of that busy time (all that more slots or a larger chunk can save)
BUSY_SHARE = 0.95
FIXED_SHARE = 0.2


@dataclass(slots=True)
class LimitLog:
    passes: int = 0                 # scheduler passes (step() calls)
    slot_waits: int = 0
    memory_waits: int = 0
    chunk_full: int = 0             # forward passes that used the whole chunk budget
    slot_wait_committed: float = 0.0   # sums over waits, for the means
    slot_wait_committed_max: float = 0.0
    memory_wait_running: int = 0
    memory_wait_committed: float = 0.0
    busy_s: float = 0.0             # the modelled GPU's time: every forward pass's, under the time model
    fixed_s: float = 0.0            # of which the fixed per-pass cost
    first_pass_s: float | None = None   # when the first forward pass began
    last_end_s: float = 0.0         # when the latest forward pass ended

    def blocked(self, cache, running: int, max_running: int) -> None:
        share = committed_share(cache)
        if running >= max_running:
            self.slot_waits += 1
            self.slot_wait_committed += share
            self.slot_wait_committed_max = max(self.slot_wait_committed_max, share)
        else:
            self.memory_waits += 1
            self.memory_wait_running += running
            self.memory_wait_committed += share

    def pass_done(self, new_tokens: int, budget: int, start_s: float | None = None, pass_s: float = 0.0,
                  fixed_s: float = 0.0) -> None:
        self.passes += 1
        if new_tokens >= budget:
            self.chunk_full += 1
        if start_s is not None:
            self.busy_s += pass_s
            self.fixed_s += fixed_s
            self.first_pass_s = start_s if self.first_pass_s is None else self.first_pass_s
            self.last_end_s = max(self.last_end_s, start_s + pass_s)

    @property
    def span_s(self) -> float:
        return self.last_end_s - self.first_pass_s if self.first_pass_s is not None else 0.0

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def committed_share(cache) -> float:
    """Share of full-token pages an admission could not have now (eviction counted as free)."""
    alloc = cache.allocator
    if alloc.full is None or not alloc.full.capacity:
        return 0.0
    idle = cache.prefix.tree.idle_pages if cache.prefix is not None else 0
    return 1.0 - (alloc.free_full_pages() + idle) / alloc.full.capacity


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    limit: str            # "slots", "memory", "chunk" or "none"
    flag: str | None      # the flag that moves it
    text: str             # one line: the figures and the advice


def verdict(log: LimitLog, plan) -> Verdict:
    from ..errors import ConfigError
    from ..planning.planner import Plan
    if not isinstance(log, LimitLog):
        raise ConfigError("log", f"{type(log).__name__} is not a LimitLog", "give a simulator's .limits")
    if not isinstance(plan, Plan):
        raise ConfigError("plan", f"{type(plan).__name__} is not a Plan", "give the cache's .plan (kvatlas.plan(...))")
    o = plan.options
    n = max(log.passes, 1)
    span = log.span_s
    if span > 0 and log.busy_s >= BUSY_SHARE * span and log.fixed_s <= FIXED_SHARE * log.busy_s:
        waits = log.slot_waits + log.memory_waits
        return Verdict(limit="compute", flag=None, text=(
            f"the modelled GPU: its passes took {log.busy_s:,.2f} s of the {span:,.2f} s from the first to the last "
            f"({100 * log.busy_s / span:.0f}% busy), and only {log.fixed_s:,.2f} s of it "
            f"({100 * log.fixed_s / log.busy_s:.0f}%) was the fixed per-pass cost that more slots or a larger chunk "
            "could spread: requests queued for compute, so no plan flag finishes them sooner; a faster GPU "
            "(the time model), more replicas (--dp), or fewer requests would"
            + (f" ({waits:,} passes also had the queue head wait for a slot or memory)" if waits else "")))
    if log.slot_waits and log.slot_waits >= log.memory_waits:
        mean = 100 * log.slot_wait_committed / log.slot_waits
        text = (f"request slots: {log.slot_waits:,} of {log.passes:,} passes waited for a slot while the full-token pages were "
                f"{mean:.0f}% committed on average (at most {100 * log.slot_wait_committed_max:.0f}%): raise "
                f"--max-running-requests (now {o.max_running_requests}; each slot costs {_slot_cost(plan)})")
        if log.slot_wait_committed_max >= 0.9:
            text += "; memory came near full too, so raise --memory with it"
        return Verdict(limit="slots", flag="--max-running-requests", text=text + _also(log.memory_waits, "memory"))
    if log.memory_waits:
        running = log.memory_wait_running / log.memory_waits
        text = (f"memory: {log.memory_waits:,} of {log.passes:,} passes waited for memory with {running:.0f} of "
                f"{o.max_running_requests} slots in use on average: " + _memory_advice(plan, running))
        return Verdict(limit="memory", flag="--memory", text=text + _also(log.slot_waits, "a slot"))
    if log.chunk_full / n > CHUNK_BOUND_SHARE:
        return Verdict(limit="chunk", flag="--chunked-prefill-tokens", text=(
            f"the chunk budget: no request waited for admission, and {log.chunk_full:,} of {log.passes:,} passes "
            f"used the whole --chunked-prefill-tokens {o.chunked_prefill_tokens:,}: raise it to prefill faster "
            "(fewer, longer passes; it sizes the SWA pages one pass may write)"))
    if span > 0 and log.busy_s >= BUSY_SHARE * span:
        return Verdict(limit="chunk", flag="--chunked-prefill-tokens", text=(
            f"the fixed per-pass cost: no request waited for a slot or memory, but the passes ran back to back "
            f"({100 * log.busy_s / span:.0f}% busy) and {log.fixed_s:,.2f} s of their {log.busy_s:,.2f} s was the "
            f"fixed cost of {log.passes:,} passes: raise --chunked-prefill-tokens (now {o.chunked_prefill_tokens:,}) "
            "to put more tokens in each"))
    return Verdict(limit="none", flag=None, text=(
        f"none: no request waited for admission, {log.chunk_full:,} of {log.passes:,} passes filled the chunk "
        f"budget, and the modelled GPU was idle {100 * (1 - log.busy_s / span) if span else 100:.0f}% of the run: "
        "the arrivals bound this run, not the plan"))


def _also(waits: int, what: str) -> str:
    return f" ({waits:,} passes waited for {what})" if waits else ""


def _slot_cost(plan) -> str:
    return f"{fmt_bytes(plan.bytes_per_request)} fixed, {plan.bytes_per_request / plan.bytes_per_token:,.0f} tokens"


def _memory_advice(plan, running: float) -> str:
    o = plan.options
    page_bytes = plan.bytes_per_token * plan.page_tokens
    if page_bytes and plan.unused_bytes >= page_bytes:   # pages capped by what the slots can address
        return (f"pages are capped at --max-running-requests × --max-model-len, leaving "
                f"{fmt_bytes(plan.unused_bytes)} of the budget unused: raise --max-model-len (now {o.max_model_len:,})")
    text = "raise --memory (or --mem-fraction)"
    if o.max_running_requests - running >= max(1.0, 0.1 * o.max_running_requests):
        text += (f", or lower --max-running-requests toward the {running:.0f} that ran: each slot costs "
                 f"{_slot_cost(plan)} of capacity")
    return text
