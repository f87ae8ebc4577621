"""What tune needs to know about a workload: its context lengths and how many requests it keeps
in flight. Pure Python over (id, arrival, prompt, output, follows) tuples, so any request source
(a trace, a synthetic stream, sessions) describes itself the same way."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class Pace:
    """The time model's three numbers (driving.timemodel), as plain floats."""

    pass_s: float = 0.020
    prefill_s_per_token: float = 40e-6
    decode_s_per_token: float = 100e-6

    def service_s(self, prompt: int, output: int, chunk: int) -> float:
        """One request alone: its prefill passes, its prompt's compute, one pass per output token."""
        passes = -(-prompt // chunk) + output
        return passes * self.pass_s + prompt * self.prefill_s_per_token + output * self.decode_s_per_token


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    requests: int
    span_s: float
    prompt_p50: int
    prompt_max: int
    context_p50: int             # prompt + output
    context_p90: int
    context_max: int
    peak_in_flight: int          # requests running at once if none ever waited
    mean_in_flight: float
    sessions: int                # conversations (first turns); equals requests without sessions
    peak_measured: bool = False  # peak_in_flight measured by the simulator, not estimated here

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def _quantile(sorted_values: list[int], q: float) -> int:
    return sorted_values[min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1)]


def profile(requests, pace: Pace = Pace(), chunk: int = 8192) -> Profile:
    """`requests`: objects with id, arrival_s, prompt_tokens, output_tokens and optionally `after`
    and `think_s` (driving.workload.Request). In flight = from arrival to the end of its service
    time alone (`Pace.service_s`); a later turn starts when the turn it follows ends."""
    reqs = list(requests)
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
    """Start times: the arrival, or for a later turn the end of the one it follows plus think time."""
    starts: dict = {}
    by_id = {r.id: r for r in reqs}
    followers: dict = {}
    for r in reqs:
        if getattr(r, "after", None) is not None:
            followers.setdefault(r.after, []).append(r)
    todo = [r for r in reqs if getattr(r, "after", None) is None or r.after not in by_id]
    while todo:
        r = todo.pop()
        prev = getattr(r, "after", None)
        start = r.arrival_s if prev is None or prev not in ends else max(r.arrival_s, ends[prev] + r.think_s)
        starts[r.id] = start
        ends[r.id] = start + pace.service_s(r.prompt_tokens, r.output_tokens, chunk)
        todo.extend(followers.get(r.id, ()))
    return starts
