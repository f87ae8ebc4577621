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

Bounds, checked before any content is made: at most MAX_TURNS_PER_SESSION turns in one session
and MAX_SESSION_REQUESTS turns in all (each turn is a request: ~0.4 KiB here, ~2 KiB with the
simulator's state). Memory is linear in the turns: a turn's content is a view of its session's.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError

MAX_TURNS_PER_SESSION = 100_000
MAX_SESSION_REQUESTS = 1_000_000
from .content import BLOCK_TOKENS, Prefix
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
    if turns_d.kind in ("fixed", "uniform") and max(turns_d.a, turns_d.b) > MAX_TURNS_PER_SESSION:
        raise ConfigError("turns", f"{turns!s} allows sessions of more than {MAX_TURNS_PER_SESSION:,} turns",
                          f"ask for at most {MAX_TURNS_PER_SESSION:,} turns per session")
    out_d, sys_d = _dist(output, "output_len"), _dist(system_len, "system_prompt_len")
    think_d = _think_dist(think)
    rng = np.random.default_rng(seed)
    starts = _session_starts(rng, rate_per_s, duration_s)
    pieces = _Pieces()
    systems = [pieces.message(int(n)) for n in sys_d.sample(rng, system_prompts)]
    which = rng.integers(0, system_prompts, len(starts)) if system_prompts else np.zeros(len(starts), np.int64)
    n_turns = turns_d.sample(rng, len(starts))
    _check_turns(n_turns)
    out: list[Request] = []
    for s, (t0, k) in enumerate(zip(starts, n_turns)):
        ids, lens = systems[which[s]] if system_prompts else ((), ())
        out += _one_session(s, float(t0), int(k), ids, lens, pieces, rng, first_d, follow_d, out_d, think_d)
    return out


def _check_turns(n_turns: np.ndarray) -> None:
    """Refuse, before any content is made, a session past the per-session bound or a total past
    the overall one (a long-tailed distribution can draw either)."""
    longest, total = int(n_turns.max(initial=0)), int(n_turns.sum())
    if longest > MAX_TURNS_PER_SESSION:
        raise ConfigError("turns", f"a session drew {longest:,} turns",
                          f"ask for at most {MAX_TURNS_PER_SESSION:,} turns per session")
    if total > MAX_SESSION_REQUESTS:
        raise ConfigError("turns", f"{total:,} turns in all (each one a request)",
                          f"ask for at most {MAX_SESSION_REQUESTS:,} (fewer turns, a lower rate or a shorter duration)")


def _think_dist(think) -> LengthDist:
    return think if isinstance(think, LengthDist) else parse_length(think, "think_s", minimum=0)


def _one_session(s: int, t0: float, turns: int, ids, lens, pieces, rng, first_d, follow_d, out_d, think_d):
    """A session's turns. Its content is one array of pieces (system prompt, then each turn's
    user message and output); turn k's blocks are a view of its first pieces (`content.Prefix`),
    so the session costs memory linear in its turns, not a copy of every earlier turn per turn."""
    user = first_d.sample(rng, turns)
    user[1:] = follow_d.sample(rng, turns - 1)
    outs = out_d.sample(rng, turns)
    think = think_d.sample_real(rng, turns)
    messages = np.stack([user, outs], axis=1).reshape(-1)             # u1, o1, u2, o2, ...
    per = -(-messages // BLOCK_TOKENS)                                  # pieces of each message
    piece_lens = np.full(int(per.sum()), BLOCK_TOKENS, np.int64)
    ends = np.cumsum(per)
    piece_lens[ends - 1] = messages - (per - 1) * BLOCK_TOKENS          # each message's last piece
    block_ids = np.concatenate((np.asarray(ids, np.int64), pieces.next_id + np.arange(len(piece_lens))))
    block_lens = np.concatenate((np.asarray(lens, np.int64), piece_lens))
    pieces.next_id += len(piece_lens)
    ends = ends.reshape(turns, 2) + len(ids)                            # after u_k, after o_k
    tokens = np.concatenate(([0], np.cumsum(block_lens)))
    reqs, prev = [], None
    for k in range(turns):
        rid = f"s{s}" if turns == 1 else f"s{s}t{k + 1}"
        n = int(ends[k, 1])
        reqs.append(Request(id=rid, arrival_s=t0, prompt_tokens=int(tokens[ends[k, 0]]), output_tokens=int(outs[k]),
                            blocks=Prefix(block_ids, n), block_lens=Prefix(block_lens, n), after=prev,
                            think_s=float(think[k]) if prev is not None else 0.0))
        prev = rid
    return reqs
