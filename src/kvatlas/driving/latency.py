"""Per-request latency on the simulator's clock: queueing delay, time to first token (TTFT) and
time per output token (TPOT), under the time model (`driving.timemodel`).

When things happen, as engines' own benchmarks count them:
- arrival: the request's `arrival_s`; a session's later turn arrives when it is released
  (`think_s` after the turn it follows finished, not before its own arrival_s);
- admission: the start of the pass whose scheduler admits it. queue_s = admitted − arrival;
- first token: the end of the pass that computes the prompt's last token (its logits give the
  first output token). ttft_s = first − arrival. A prefix hit's cached tokens are not computed,
  so a hit shortens the prefill passes, and with them TTFT;
- later tokens: each decode pass emits 1 + the drafts it accepted; the last token is emitted at
  the end of the pass in which the emitted count reaches output_tokens. e2e_s = last − arrival,
  tpot_s = (last − first) / (output_tokens − 1) (none for a one-token output).

A pass ends `time_model.pass_time_s(...)` after it starts. The simulator writes the KV row of
every output token, the last one too, so it holds a request one pass past its last token (the
memory figures include that pass; these latencies do not).

Percentiles are numpy's default (linear between the two nearest ranks), over finished requests,
for all of them and split by whether the request hit the prefix cache (cached_tokens > 0).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError

PERCENTILES = (50, 90, 99)
FIGURES = ("queue_s", "ttft_s", "tpot_s", "e2e_s")
GROUPS = ("all", "hit", "miss")


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestTiming:
    id: str
    status: str                      # finished / running / waiting / rejected_too_long
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int | None        # prompt tokens the prefix cache supplied (None: never admitted)
    arrival_s: float | None
    admitted_s: float | None
    first_token_s: float | None
    last_token_s: float | None

    def _since(self, t: float | None, start: float | None) -> float | None:
        return None if t is None or start is None else t - start

    @property
    def queue_s(self) -> float | None:
        return self._since(self.admitted_s, self.arrival_s)

    @property
    def ttft_s(self) -> float | None:
        return self._since(self.first_token_s, self.arrival_s)

    @property
    def e2e_s(self) -> float | None:
        return self._since(self.last_token_s, self.arrival_s)

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2 or self.last_token_s is None or self.first_token_s is None:
            return None
        return (self.last_token_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def hit(self) -> bool:
        return bool(self.cached_tokens)


@dataclass(slots=True)
class _Record:
    req: object
    arrival_s: float | None = None
    admitted_s: float | None = None
    cached_tokens: int | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    rejected: bool = False


class LatencyLog:
    """What the simulator tells it, in order: arrived, admitted, then within a pass prefilled
    (the prompt's last token computed) and last_token; pass_ended stamps both with the pass's end."""

    def __init__(self) -> None:
        self._records: dict[str, _Record] = {}
        self._firsts: list[_Record] = []    # this pass: prompts completed
        self._lasts: list[_Record] = []     # this pass: last tokens emitted

    def _of(self, req) -> _Record:
        rec = self._records.get(req.id)
        if rec is None:
            rec = self._records[req.id] = _Record(req)
        return rec

    def arrived(self, req, t_s: float) -> None:
        self._of(req).arrival_s = t_s

    def rejected(self, req) -> None:
        self._of(req).rejected = True

    def admitted(self, req, t_s: float, cached_tokens: int) -> None:
        rec = self._of(req)
        rec.admitted_s, rec.cached_tokens = t_s, cached_tokens

    def prefilled(self, req) -> None:
        rec = self._records[req.id]
        self._firsts.append(rec)
        if req.output_tokens == 1:          # the prefill's token is the only one
            self._lasts.append(rec)

    def decoded(self, req, before: int, after: int) -> None:
        """A decode pass took the request's written output from `before` to `after` tokens; with
        the prefill's token, 1 + after are emitted."""
        if before + 1 < req.output_tokens <= after + 1:
            self._lasts.append(self._records[req.id])

    def pass_ended(self, end_s: float) -> None:
        for rec in self._firsts:
            rec.first_token_s = end_s
        for rec in self._lasts:
            rec.last_token_s = end_s
        self._firsts.clear()
        self._lasts.clear()

    # ------------------------------------------------------------------ results
    def timings(self, requests=()) -> list[RequestTiming]:
        """One per request seen, in arrival order; `requests` adds those that never arrived."""
        recs = list(self._records.values())
        seen = set(self._records)
        recs += [_Record(r) for r in requests if r.id not in seen]
        return [_timing(r) for r in recs]

    def summary(self) -> dict:
        """{group: {figure: {"count", "mean", "p50", "p90", "p99"}}} over finished requests."""
        done = [t for t in self.timings() if t.status == "finished"]
        return {g: {f: percentiles([getattr(t, f) for t in done if _in(g, t)]) for f in FIGURES} for g in GROUPS}


def _in(group: str, t: RequestTiming) -> bool:
    return group == "all" or (group == "hit") == t.hit


def _timing(r: _Record) -> RequestTiming:
    if r.rejected:
        status = "rejected_too_long"
    elif r.last_token_s is not None:
        status = "finished"
    elif r.admitted_s is not None:
        status = "running"
    else:
        status = "waiting"
    return RequestTiming(id=r.req.id, status=status, prompt_tokens=r.req.prompt_tokens,
                         output_tokens=r.req.output_tokens, cached_tokens=r.cached_tokens, arrival_s=r.arrival_s,
                         admitted_s=r.admitted_s, first_token_s=r.first_token_s, last_token_s=r.last_token_s)


def percentiles(values) -> dict:
    """count, mean, p50, p90, p99 of the values that are not None (None when there are none)."""
    v = np.array([x for x in values if x is not None], dtype=np.float64)
    if not len(v):
        return {"count": 0, "mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ps = np.percentile(v, PERCENTILES)
    return {"count": int(len(v)), "mean": float(v.mean()), **{f"p{q}": float(p) for q, p in zip(PERCENTILES, ps)}}


CSV_COLUMNS = ("id", "status", "prompt_tokens", "cached_tokens", "output_tokens", "arrival_s", "admitted_s",
               "first_token_s", "last_token_s", "queue_s", "ttft_s", "tpot_s", "e2e_s")


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6f}" if math.isfinite(v) else str(v)
    return str(v)


def write_requests_csv(path: str, timings) -> None:
    """One row per request: its status, lengths, event times and latencies (seconds; empty where
    the request never got there). `timings`: RequestTiming objects (LatencyLog.timings()); both
    arguments are checked before the file is opened, a path that cannot be written is refused."""
    import os
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigError("path", f"{path!r} is not a file path", "give a path such as run.requests.csv")
    if isinstance(timings, (str, bytes, dict)) or not hasattr(timings, "__iter__"):
        raise ConfigError("timings", f"{type(timings).__name__} is not a list of request timings",
                          "give LatencyLog.timings()")
    timings = list(timings)
    bad = [t for t in timings if not all(hasattr(t, c) for c in CSV_COLUMNS)][:1]   # None is a bad one too
    if bad:
        raise ConfigError("timings", f"{bad[0]!r:.40} is not a request timing", "give LatencyLog.timings()")
    try:
        fh = open(path, "w", newline="", encoding="utf-8")
    except OSError as exc:
        raise ConfigError("path", f"{os.fspath(path)!r} cannot be written ({exc.strerror or exc})",
                          "write it somewhere else") from None
    with fh:
        w = csv.writer(fh)
        w.writerow(CSV_COLUMNS)
        for t in timings:
            w.writerow([_cell(getattr(t, c)) for c in CSV_COLUMNS])
