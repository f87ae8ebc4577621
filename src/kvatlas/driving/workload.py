"""Workloads: requests, synthetic request streams (`synthetic`; sessions and shared system
prompts in `sessions`), and traces (`traces`: kvatlas's JSONL and Mooncake's).

A request is (id, arrival_s, prompt_tokens, output_tokens), optionally with content: the block ids
whose deterministic tokens (`content`) make its prompt, so a content-addressed cache sees the
prefixes requests share. Synthetic arrivals are a Poisson process of `rate_per_s` over
`duration_s`; lengths come from a distribution given as text, so the same spec works on the
command line and in Python:

    "512"                    every request 512 tokens
    "uniform:64:2048"        uniform integers in [64, 2048]
    "exp:300"                exponential with mean 300 (at least 1)
    "lognormal:1024:0.8"     log-normal with median 1024 and sigma 0.8 (at least 1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from .content import covered_tokens, prompt_tokens_of


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """One request. `blocks` (optional) is its content: block ids whose tokens (`driving.content`)
    make the prompt (and, when they cover more, the output), each a whole 512-token block or,
    with `block_lens`, the first block_lens[i] tokens of block i. `after` (optional) is the id of the request this one
    follows (the previous turn of a session): it arrives `think_s` after that one finishes, and
    not before `arrival_s`."""

    id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int, ...] | None = None
    block_lens: tuple[int, ...] | None = None
    after: str | None = None
    think_s: float = 0.0

    def __post_init__(self) -> None:
        """Refuse what would break a run later (a NaN arrival, a length of 0, content too short)."""
        for name in ("prompt_tokens", "output_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ConfigError(name, f"{v!r} in request {self.id!r}", "give a whole number of tokens ≥ 1")
        for name in ("arrival_s", "think_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(name, f"{v!r} in request {self.id!r}", "give a finite number of seconds ≥ 0")
        if self.block_lens is not None and (self.blocks is None or len(self.block_lens) != len(self.blocks)):
            raise ConfigError("block_lens", f"does not match blocks in request {self.id!r}",
                              "give one length per block id")
        if self.blocks is not None and covered_tokens(self.blocks, self.block_lens) < self.prompt_tokens:
            raise ConfigError("blocks", f"cover fewer tokens than prompt_tokens={self.prompt_tokens} in request "
                              f"{self.id!r}", "give enough block ids (one per 512 tokens)")

    def token_ids(self) -> np.ndarray | None:
        """The prompt's token ids (int32, prompt_tokens of them), the same for equal blocks in any
        run; None when the request carries no content (a plain length-only workload)."""
        if self.blocks is None:
            return None
        return prompt_tokens_of(self.blocks, self.block_lens, self.prompt_tokens)

    def output_token_ids(self) -> np.ndarray | None:
        """The tokens this request generates, when its content says (a synthetic session's turn:
        the next turn's prompt repeats them); None otherwise (Mooncake traces give prompts only)."""
        end = self.prompt_tokens + self.output_tokens
        if self.blocks is None or covered_tokens(self.blocks, self.block_lens) < end:
            return None
        return prompt_tokens_of(self.blocks, self.block_lens, end, start=self.prompt_tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthDist:
    kind: str           # fixed | uniform | exp | lognormal
    a: float
    b: float = 0.0

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Whole token counts ≥ 1."""
        if self.kind == "uniform":
            x = rng.integers(int(self.a), int(self.b) + 1, n)
        else:
            x = self.sample_real(rng, n)
        return np.maximum(np.rint(x), 1).astype(np.int64)

    def sample_real(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Real values (think times in seconds): uniform is continuous here."""
        if self.kind == "fixed":
            return np.full(n, float(self.a))
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b, n)
        if self.kind == "exp":
            return rng.exponential(self.a, n) if self.a > 0 else np.zeros(n)
        return rng.lognormal(math.log(self.a), self.b, n)


def parse_length(text: str, field: str = "length", minimum: float = 1) -> LengthDist:
    """Parse a length distribution spec (see the module doc); its first parameter ≥ minimum
    (token counts: 1; think times in seconds: 0)."""
    fix = f"write N, uniform:LO:HI, exp:MEAN or lognormal:MEDIAN:SIGMA (values ≥ {minimum:g})"
    parts = str(text).strip().split(":")
    try:
        nums = [float(p) for p in parts[1:]] if len(parts) > 1 else [float(parts[0])]
    except ValueError:
        raise ConfigError(field, f"{text!r} is not a length distribution", fix) from None
    kind = "fixed" if len(parts) == 1 else parts[0]
    arity = {"fixed": 1, "uniform": 2, "exp": 1, "lognormal": 2}
    if kind not in arity or len(nums) != arity[kind]:
        raise ConfigError(field, f"{text!r} is not a length distribution", fix)
    if not all(math.isfinite(x) for x in nums) or nums[0] < minimum or (kind == "uniform" and nums[1] < nums[0]) \
            or (kind == "lognormal" and (nums[1] < 0 or nums[0] <= 0)):
        raise ConfigError(field, f"{text!r} has an out-of-range parameter", fix)
    return LengthDist(kind=kind, a=nums[0], b=nums[1] if len(nums) > 1 else 0.0)


def synthetic(*, rate_per_s: float, duration_s: float, prompt: str | LengthDist = "uniform:64:1024",
              output: str | LengthDist = "uniform:16:256", seed: int = 0) -> list[Request]:
    """Poisson arrivals at rate_per_s during [0, duration_s); the same seed gives the same list."""
    if not rate_per_s > 0:
        raise ConfigError("rate", f"{rate_per_s!r} requests/s", "give a rate above 0")
    if not duration_s > 0:
        raise ConfigError("duration", f"{duration_s!r} s", "give a duration above 0")
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
