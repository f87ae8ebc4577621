"""What the prefix cache served, kept for a refit: each finished request's arrival at the cache
(when a scheduler enqueued it, else when it was admitted), prompt length, prompt page keys and the
tokens it then wrote.

How many resume points a plan should hold is fitted by replaying a workload
(kvatlas.driving.fit), and the pools are fixed once allocated; the workload that matters is the one
the cache is serving. `PrefixCache.record()` keeps the latest requests it served as `Served` rows,
and `kvatlas.driving.traces.served_requests()` turns them into a trace that shares exactly what
they shared: page keys are chained (a page's key names its whole prefix), so giving each key its
own content reproduces every shared prefix, page for page, and nothing more. The fit (or
`kvatlas simulate --workload`) replays that trace; the count it finds is for the next start.

Bounded: the latest `max_requests` finished requests (a deque), the keys of those still running
until they finish. Neutral data only (no import of `driving/`, which sits above).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from ..checks import whole
from ..errors import ConfigError

MAX_RECORDED = 1 << 24


@dataclass(frozen=True, slots=True)
class Served:
    arrival_s: float        # seconds after recording began, by the recorder's clock: when it was
                            # enqueued (PrefixCache.enqueue), else when it was admitted
    prompt_tokens: int
    output_tokens: int      # tokens written after the prompt by the finish (0: cut at the prompt)
    page_keys: np.ndarray   # its full pages' keys (int64): the prompt's, and those it wrote after
                            # when its finish keyed them; empty: admitted without content
    page_tokens: int        # tokens a key covers (the plan's page)
    order: int = 0          # requests that arrived before it (enqueued, else admitted): ties of
                            # arrival_s replay in this order


class Recorder:
    def __init__(self, max_requests: int, clock, page_tokens: int) -> None:
        self.max_requests = whole("max_requests", max_requests, 1, MAX_RECORDED)
        if not callable(clock):
            raise ConfigError("clock", f"{type(clock).__name__} is not callable",
                              "give a function of no arguments that returns seconds, e.g. time.monotonic")
        self.clock, self.P = clock, page_tokens
        self.t0 = float(clock())
        self.waiting: dict = {}   # request id -> (arrival, order), while queued (PrefixCache.enqueue)
        self.running: dict = {}   # request id -> (arrival, prompt tokens, keys, order)
        self.served: deque = deque(maxlen=self.max_requests)
        self.arrivals = 0         # requests seen arriving (enqueued, or admitted unqueued)
        self.finished_total = 0   # requests served since recording began (more than `served` holds)

    def _arrival(self) -> tuple[float, int]:
        self.arrivals += 1
        return float(self.clock()) - self.t0, self.arrivals - 1

    def queued(self, request_id) -> None:
        self.waiting[request_id] = self._arrival()

    def left_queue(self, request_id) -> None:
        self.waiting.pop(request_id, None)

    def admitted(self, request_id, prompt_tokens: int, keys) -> None:
        arrival, order = self.waiting.pop(request_id, None) or self._arrival()
        self.running[request_id] = (arrival, int(prompt_tokens), np.asarray(keys, np.int64).copy(), order)

    def finished(self, request_id, length: int, keys=None) -> None:
        """`keys`: the finish's keys of every full page it wrote, when it keyed more than the
        prompt's (the generated tokens given): those pages were shareable too."""
        row = self.running.pop(request_id, None)
        if row is not None:
            arrival, prompt, prompt_keys, order = row
            if keys is not None and len(keys) > len(prompt_keys):
                prompt_keys = np.asarray(keys, np.int64).copy()
            self.served.append(Served(max(arrival, 0.0), prompt, max(int(length) - prompt, 0), prompt_keys,
                                      self.P, order))
            self.finished_total += 1

