"""Workloads: a synthetic request stream, or a JSONL trace.

A request is (id, arrival_s, prompt_tokens, output_tokens). Synthetic arrivals are a Poisson
process of `rate_per_s` over `duration_s`; lengths come from a distribution given as text, so the
same spec works on the command line and in Python:

    "512"                    every request 512 tokens
    "uniform:64:2048"        uniform integers in [64, 2048]
    "exp:300"                exponential with mean 300 (at least 1)
    "lognormal:1024:0.8"     log-normal with median 1024 and sigma 0.8 (at least 1)

A trace has one JSON object per line: {"arrival_s": 0.12, "prompt_tokens": 900, "output_tokens": 128}
(an optional "id"); blank lines and lines starting with '#' are ignored. A malformed line is
reported with its line number and skipped, or, with strict=True, fatal.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from ..checks import MAX_COUNT, real, whole
from ..errors import ConfigError

# Synthetic workloads: bounds that keep the arrival list a list (10 M requests, ~1 GB of Python
# objects at most) rather than a request to numpy for terabytes.
MAX_RATE_PER_S = 1e6
MAX_DURATION_S = 1e7
MAX_SYNTHETIC_REQUESTS = 10_000_000
MAX_LENGTH_TOKENS = MAX_COUNT   # beyond any model's context; longer samples are clipped to it


class TraceError(ConfigError):
    """A line of a JSONL trace is malformed."""

    def __init__(self, path: str, line_no: int, problem: str) -> None:
        self.line_no = line_no
        super().__init__(f"{path}:{line_no}", problem,
                         'write one object per line: {"arrival_s": 0.5, "prompt_tokens": 900, "output_tokens": 128}')


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthDist:
    kind: str           # fixed | uniform | exp | lognormal
    a: float
    b: float = 0.0

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            x = np.full(n, self.a)
        elif self.kind == "uniform":
            x = rng.integers(int(self.a), int(self.b) + 1, n)
        elif self.kind == "exp":
            x = rng.exponential(self.a, n)
        else:
            x = rng.lognormal(math.log(self.a), self.b, n)
        return np.clip(np.rint(x), 1, MAX_LENGTH_TOKENS).astype(np.int64)   # a lognormal tail may reach inf


def parse_length(text: str, field: str = "length") -> LengthDist:
    """Parse a length distribution spec (see the module doc)."""
    fix = "write N, uniform:LO:HI, exp:MEAN or lognormal:MEDIAN:SIGMA (token counts ≥ 1)"
    parts = str(text).strip().split(":")
    try:
        nums = [float(p) for p in parts[1:]] if len(parts) > 1 else [float(parts[0])]
    except ValueError:
        raise ConfigError(field, f"{text!r} is not a length distribution", fix) from None
    if not all(math.isfinite(v) for v in nums):
        raise ConfigError(field, f"{text!r} has a parameter that is not finite", fix)
    kind = "fixed" if len(parts) == 1 else parts[0]
    arity = {"fixed": 1, "uniform": 2, "exp": 1, "lognormal": 2}
    if kind not in arity or len(nums) != arity[kind]:
        raise ConfigError(field, f"{text!r} is not a length distribution", fix)
    if nums[0] < 1 or nums[0] > MAX_LENGTH_TOKENS or (kind == "uniform" and not nums[0] <= nums[1] <= MAX_LENGTH_TOKENS) \
            or (kind == "lognormal" and not 0 <= nums[1] <= 10):
        raise ConfigError(field, f"{text!r} has an out-of-range parameter", fix)
    return LengthDist(kind=kind, a=nums[0], b=nums[1] if len(nums) > 1 else 0.0)


def synthetic(*, rate_per_s: float, duration_s: float, prompt: str | LengthDist = "uniform:64:1024",
              output: str | LengthDist = "uniform:16:256", seed: int = 0) -> list[Request]:
    """Poisson arrivals at rate_per_s during [0, duration_s); the same seed gives the same list."""
    real("rate", rate_per_s, 0.0, MAX_RATE_PER_S, open_low=True)
    real("duration", duration_s, 0.0, MAX_DURATION_S, open_low=True)
    whole("seed", seed, 0, 2**63 - 1)
    if rate_per_s * duration_s > MAX_SYNTHETIC_REQUESTS:
        raise ConfigError("rate", f"rate × duration = {rate_per_s * duration_s:,.0f} requests",
                          f"ask for at most {MAX_SYNTHETIC_REQUESTS:,} (lower the rate or the duration)")
    pd = prompt if isinstance(prompt, LengthDist) else parse_length(prompt, "prompt_len")
    od = output if isinstance(output, LengthDist) else parse_length(output, "output_len")
    rng = np.random.default_rng(seed)
    expected = rate_per_s * duration_s
    gaps = rng.exponential(1.0 / rate_per_s, int(expected + 10 * math.sqrt(expected) + 10))
    arrivals = np.cumsum(gaps)
    arrivals = arrivals[arrivals < duration_s]
    n = len(arrivals)
    prompts, outputs = pd.sample(rng, n), od.sample(rng, n)
    return [Request(id=f"r{i}", arrival_s=float(arrivals[i]), prompt_tokens=int(prompts[i]),
                    output_tokens=int(outputs[i])) for i in range(n)]


def _positive_int(obj: dict, key: str) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{key!r} must be an integer ≥ 1, got {v!r}")
    return v


def parse_trace_line(line: str, line_no: int) -> Request:
    """One trace line as a Request; ValueError says what is wrong with it."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    t = obj.get("arrival_s")
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
        raise ValueError(f"'arrival_s' must be a number ≥ 0 (seconds), got {t!r}")
    rid = obj.get("id", f"line{line_no}")
    return Request(id=str(rid), arrival_s=float(t), prompt_tokens=_positive_int(obj, "prompt_tokens"),
                   output_tokens=_positive_int(obj, "output_tokens"))


def read_trace(path: str, *, strict: bool = False, on_error=None) -> tuple[list[Request], list[tuple[int, str]]]:
    """(requests sorted by arrival, [(line number, problem)] of the skipped lines).

    strict=True raises TraceError at the first malformed line; otherwise each is reported through
    `on_error(line_no, problem)` (if given) and skipped."""
    requests, problems = [], []
    try:
        fh = open(path, encoding="utf-8")
    except OSError as exc:
        raise ConfigError("workload", f"cannot read {path!r} ({exc.strerror})", "give an existing JSONL file") from None
    with fh:
        for line_no, line in enumerate(fh, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            try:
                requests.append(parse_trace_line(text, line_no))
            except ValueError as exc:
                if strict:
                    raise TraceError(path, line_no, str(exc)) from None
                problems.append((line_no, str(exc)))
                if on_error is not None:
                    on_error(line_no, str(exc))
    requests.sort(key=lambda r: r.arrival_s)
    return requests, problems


def write_trace(path: str, requests: list[Request]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for r in requests:
            fh.write(json.dumps({"id": r.id, "arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
                                 "output_tokens": r.output_tokens}) + "\n")
