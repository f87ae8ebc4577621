"""The simulator's time model: how long one forward pass takes, from the tokens it computes.

    pass_s = pass_s (fixed) + prefill_tokens × prefill_s_per_token + decode_tokens × decode_s_per_token

- `prefill_tokens`: prompt tokens computed in the pass (a prefix-cache hit is not computed, so
  it costs nothing: that is the saving a hit buys, and the only way a policy changes time);
- `decode_tokens`: tokens written by decoding requests (1 + drafts each);
- `pass_s`: what every pass costs whatever it holds (weights read, launches, sampling).

Linear in tokens, with no term in context length, because DeepSeek-V4's attention is sparse:
each query reads the top-k (2,048) compressed entries the indexer selects plus the 128-token
sliding window, so its attention work does not grow with the prompt (the indexer's scan does,
but it is a small 128-wide dot product per compressed entry). The same model, with the same
numbers, applies to every cache policy of a run, so policies differ only in the tokens they make
the engine compute.

The defaults are round assumptions for one H200 running V4-Flash (13B activated parameters,
about 26 GFLOP per token: 25K prefill tokens/s is ~650 TFLOP/s, FP8-class throughput at a good
utilisation; 20 ms per pass for a decode step's weight reads; 0.1 ms per extra decoded token).
They are not measurements; give your engine's numbers with --step-ms, --prefill-us-per-token and
--decode-us-per-token. With prefill and decode at 0 every pass takes pass_s (the old fixed clock).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError

DEFAULT_PASS_S = 0.020
DEFAULT_PREFILL_S_PER_TOKEN = 40e-6
DEFAULT_DECODE_S_PER_TOKEN = 100e-6


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeModel:
    pass_s: float = DEFAULT_PASS_S
    prefill_s_per_token: float = 0.0
    decode_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        for name in ("pass_s", "prefill_s_per_token", "decode_s_per_token"):
            v = getattr(self, name)
            number = not isinstance(v, bool) and isinstance(v, (int, float))
            if not number or not math.isfinite(v) or not (v > 0 if name == "pass_s" else v >= 0):
                raise ConfigError(name, f"{v!r} s is not a duration the model can use",
                                  "give a finite number of seconds, " + ("above 0" if name == "pass_s" else "≥ 0"))

    def pass_time_s(self, prefill_tokens: int, decode_tokens: int) -> float:
        return self.pass_s + prefill_tokens * self.prefill_s_per_token + decode_tokens * self.decode_s_per_token

    def describe(self) -> str:
        return (f"pass = {self.pass_s * 1e3:g} ms + {self.prefill_s_per_token * 1e6:g} µs × prefill tokens "
                f"+ {self.decode_s_per_token * 1e6:g} µs × decode tokens (hit tokens are not prefilled)")


def default_time_model() -> TimeModel:
    """The CLI's defaults (see the module doc for where they come from)."""
    return TimeModel(pass_s=DEFAULT_PASS_S, prefill_s_per_token=DEFAULT_PREFILL_S_PER_TOKEN,
                     decode_s_per_token=DEFAULT_DECODE_S_PER_TOKEN)
