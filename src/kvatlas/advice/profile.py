"""What tune needs to know about a workload: its context lengths and how many requests it keeps
in flight. Pure Python over (id, arrival, prompt, output, follows) tuples, so any request source
(a trace, a synthetic stream, sessions) describes itself the same way."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from ..checks import real, whole
from ..errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class Pace:
    """The time model's three numbers (driving.timemodel), as plain floats: each a finite number
    of seconds, the pass's above 0, the per-token ones at least 0 (checked when made)."""

    pass_s: float = 0.020
    prefill_s_per_token: float = 40e-6
    decode_s_per_token: float = 100e-6

    def __post_init__(self) -> None:
        real("pass_s", self.pass_s, 0.0, 3600.0, open_low=True)
        real("prefill_s_per_token", self.prefill_s_per_token, 0.0, 1e3)
        real("decode_s_per_token", self.decode_s_per_token, 0.0, 1e3)

    def prefill_s(self, tokens: int, chunk: int) -> float:
        """What `tokens` prompt tokens take of a prefill stream that runs `chunk` tokens a pass."""
        return tokens * (self.prefill_s_per_token + self.pass_s / chunk)

    def full_pass_s(self, chunk: int) -> float:
        return self.pass_s + chunk * self.prefill_s_per_token


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    requests: int
    span_s: float
    prompt_p50: int
    prompt_max: int
    context_p50: int             # prompt + output
    context_p90: int
    context_max: int
    peak_in_flight: int          # requests holding a slot at once (prefilling or decoding), fluid model
    mean_in_flight: float
    sessions: int                # conversations (first turns); equals requests without sessions

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def check_pace(pace, field: str = "pace") -> None:
    if not isinstance(pace, Pace):
        raise ConfigError(field, f"{type(pace).__name__} is not a Pace", "give kvatlas.advice.Pace(pass_s=..., ...)")


def _quantile(sorted_values: list[int], q: float) -> int:
    return sorted_values[min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1)]


def profile(requests, pace: Pace = Pace(), chunk: int = 8192) -> Profile:
    """`requests`: objects with id, arrival_s, prompt_tokens, output_tokens and optionally `after`
    and `think_s` (driving.workload.Request). In flight = from arrival to its end on the fluid
    model of `_starts` (an estimate; `kvatlas tune --simulate` measures the peak instead)."""
    check_pace(pace)
    whole("chunk", chunk, 1, 1 << 30)
    if requests is None or isinstance(requests, (str, bytes, dict)) or not hasattr(requests, "__iter__"):
        raise ConfigError("requests", f"{type(requests).__name__} is not a list of requests",
                          "give requests with id, arrival_s, prompt_tokens and output_tokens (kvatlas.driving.workload)")
    reqs = list(requests)
    fields = ("id", "arrival_s", "prompt_tokens", "output_tokens")
    bad = [r for r in reqs if not all(hasattr(r, a) for a in fields)][:1]   # a list: None is a bad one too
    if bad:
        raise ConfigError("requests", f"{bad[0]!r:.40} is not a request",
                          "give requests with id, arrival_s, prompt_tokens and output_tokens (kvatlas.driving.workload)")
    if not reqs:
        raise ConfigError("workload", "holds no request", "give a trace or a synthetic workload with requests")
    ends: dict = {}
    starts = _starts(sorted(reqs, key=lambda r: r.arrival_s), pace, chunk, ends)
    spans = sorted((starts[r.id], ends[r.id]) for r in reqs)
    peak, heap, area = 0, [], 0.0
    for start, end in spans:
        while heap and heap[0] <= start:
            heapq.heappop(heap)
        heapq.heappush(heap, end)
        peak = max(peak, len(heap))
        area += end - start
    first, last = spans[0][0], max(e for _, e in spans)
    ctx = sorted(r.prompt_tokens + r.output_tokens for r in reqs)
    prompts = sorted(r.prompt_tokens for r in reqs)
    span = max(last - first, 1e-9)
    return Profile(requests=len(reqs), span_s=span, prompt_p50=_quantile(prompts, 0.5),
                   prompt_max=prompts[-1], context_p50=_quantile(ctx, 0.5),
                   context_p90=_quantile(ctx, 0.9), context_max=ctx[-1], peak_in_flight=peak,
                   mean_in_flight=area / span, sessions=sum(1 for r in reqs if getattr(r, "after", None) is None))


def _starts(reqs, pace: Pace, chunk: int, ends: dict) -> dict:
    """When each request holds a slot, on a fluid model of continuous batching: one prefill stream
    of `chunk` tokens a pass, first come first served; a request takes its slot when its prefill
    starts (before that it waits in the queue, as engines' waiting queues hold it) and decodes one
    token a pass, a pass being a full chunk long while prompts wait behind it. A later turn
    arrives when the turn it follows ends, plus its think time."""
    starts: dict = {}
    by_id = {r.id: r for r in reqs}
    followers: dict = {}
    for r in reqs:
        if getattr(r, "after", None) is not None and r.after in by_id:
            followers.setdefault(r.after, []).append(r)
    ready = [(r.arrival_s, i, r) for i, r in enumerate(reqs) if getattr(r, "after", None) is None or r.after not in by_id]
    heapq.heapify(ready)
    order, stream_free = len(reqs), 0.0
    while ready:
        start, _, r = heapq.heappop(ready)
        begin = max(start, stream_free)
        stream_free = begin + pace.prefill_s(r.prompt_tokens, chunk)
        busy = stream_free > start + pace.prefill_s(r.prompt_tokens, chunk)   # prompts waited: passes are full
        per_pass = pace.full_pass_s(chunk) if busy else pace.pass_s
        starts[r.id] = begin   # it waits for the stream in the queue, without a slot
        ends[r.id] = stream_free + r.output_tokens * (per_pass + pace.decode_s_per_token)
        for f in followers.get(r.id, ()):
            order += 1
            heapq.heappush(ready, (max(f.arrival_s, ends[r.id] + f.think_s), order, f))
    return starts
