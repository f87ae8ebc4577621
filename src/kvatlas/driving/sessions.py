"""Synthetic workloads with prefix structure: multi-turn sessions and shared system prompts.

Sessions start as a Poisson process of `rate_per_s` over `duration_s`. A session has a number of
turns (a length distribution, `workload.parse_length`); each turn is a request whose prompt is

    turn 1:  [system prompt] + first user message              (first_len tokens)
    turn k:  prompt of turn k-1 + output of turn k-1 + follow-up user message   (followup_len)

and turn k arrives `think_s` after turn k-1 finishes (the simulator holds it until then:
`Request.after`). With `system_prompts` = N > 0, each session opens with one of N system prompts
(chosen uniformly; lengths drawn once per prompt from `system_len`), so many requests share them.
With one turn per session and system prompts, this is the shared-system-prompt workload.

Content is pieces of deterministic tokens (`driving.content`): the system prompts, every user
message and every output get fresh block ids (one per 512 tokens), so two requests share tokens
exactly where the workload says they do. A turn's content also covers its own output, so
`Request.output_token_ids()` gives the tokens the next turn sends back.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError
from .content import BLOCK_TOKENS
from .workload import LengthDist, Request, parse_length


class _Pieces:
    """Hands out fresh block ids; a message of n tokens is ceil(n / 512) pieces."""

    def __init__(self) -> None:
        self.next_id = 0

    def message(self, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        full, rest = divmod(n, BLOCK_TOKENS)
        lens = (BLOCK_TOKENS,) * full + ((rest,) if rest else ())
        ids = tuple(range(self.next_id, self.next_id + len(lens)))
        self.next_id += len(lens)
        return ids, lens


def _dist(value, field: str) -> LengthDist:
    return value if isinstance(value, LengthDist) else parse_length(value, field)


def _session_starts(rng, rate_per_s: float, duration_s: float) -> np.ndarray:
    if not (isinstance(rate_per_s, (int, float)) and math.isfinite(rate_per_s) and rate_per_s > 0):
        raise ConfigError("rate", f"{rate_per_s!r} sessions/s", "give a finite rate above 0")
    if not (isinstance(duration_s, (int, float)) and math.isfinite(duration_s) and duration_s > 0):
        raise ConfigError("duration", f"{duration_s!r} s", "give a finite duration above 0")
    expected = rate_per_s * duration_s
    if expected > 1e7:
        raise ConfigError("rate", f"{rate_per_s} × {duration_s} s is {expected:.3g} sessions",
                          "ask for at most 10 million")
    gaps = rng.exponential(1.0 / rate_per_s, int(expected + 10 * math.sqrt(expected) + 10))
    starts = np.cumsum(gaps)
    return starts[starts < duration_s]


def sessions(*, rate_per_s: float, duration_s: float, turns="1", first_len="uniform:64:1024",
             followup_len="uniform:16:256", output="uniform:16:256", think="exp:5",
             system_prompts: int = 0, system_len="2048", seed: int = 0) -> list[Request]:
    """Multi-turn sessions (see the module doc); requests in session order, turns in order.
    `think`: seconds between a turn's end and the next turn, in the same spec forms ("exp:5",
    "0" for none)."""
    for name, v in (("system_prompts", system_prompts), ("seed", seed)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(name, f"{v!r}", "give a whole number ≥ 0")
    turns_d, first_d, follow_d = _dist(turns, "turns"), _dist(first_len, "prompt_len"), _dist(followup_len, "followup_len")
    out_d, sys_d = _dist(output, "output_len"), _dist(system_len, "system_prompt_len")
    think_d = _think_dist(think)
    rng = np.random.default_rng(seed)
    starts = _session_starts(rng, rate_per_s, duration_s)
    pieces = _Pieces()
    systems = [pieces.message(int(n)) for n in sys_d.sample(rng, system_prompts)]
    which = rng.integers(0, system_prompts, len(starts)) if system_prompts else np.zeros(len(starts), np.int64)
    n_turns = turns_d.sample(rng, len(starts))
    out: list[Request] = []
    for s, (t0, k) in enumerate(zip(starts, n_turns)):
        ids, lens = systems[which[s]] if system_prompts else ((), ())
        out += _one_session(s, float(t0), int(k), ids, lens, pieces, rng, first_d, follow_d, out_d, think_d)
    return out


def _think_dist(think) -> LengthDist:
    return think if isinstance(think, LengthDist) else parse_length(think, "think_s", minimum=0)


def _one_session(s: int, t0: float, turns: int, ids, lens, pieces, rng, first_d, follow_d, out_d, think_d):
    reqs, prev = [], None
    user = first_d.sample(rng, turns)
    user[1:] = follow_d.sample(rng, turns - 1)
    outs = out_d.sample(rng, turns)
    think = think_d.sample_real(rng, turns)
    for k in range(turns):
        u_ids, u_lens = pieces.message(int(user[k]))
        o_ids, o_lens = pieces.message(int(outs[k]))
        prompt_ids, prompt_lens = ids + u_ids, lens + u_lens
        rid = f"s{s}" if turns == 1 else f"s{s}t{k + 1}"
        reqs.append(Request(id=rid, arrival_s=t0, prompt_tokens=int(sum(prompt_lens)), output_tokens=int(outs[k]),
                            blocks=prompt_ids + o_ids, block_lens=prompt_lens + o_lens, after=prev,
                            think_s=float(think[k]) if prev is not None else 0.0))
        ids, lens, prev = prompt_ids + o_ids, prompt_lens + o_lens, rid
    return reqs
