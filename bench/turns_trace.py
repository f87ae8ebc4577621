"""A multi-turn conversation trace in the Mooncake format, for checking prefix-cache figures on
traffic unlike the shared synthetic trace (whose sharing is mostly system prompts and documents).

Conversations start as a Poisson process (`--rate` per second). Each opens, with probability
`--system-share`, with one of `--system-prompts` shared system prompts (1-8 blocks of 512
tokens), then a first user message; each later turn's prompt is the previous turn's whole prompt,
then its answer, then a follow-up message (fresh blocks for both), so turn k+1's `hash_ids` start
with all of turn k's. A turn arrives `--think` seconds (uniform range) after the one before it,
long enough that its predecessor has usually finished on the bench's virtual clock (the format has
no dependency between requests: the replay sends it at its timestamp either way). Turns per
conversation: 1 + a geometric number (mean `--mean-turns`), at most 16. Prompt lengths are not
block multiples (a turn's last block is partial; the next turn, sharing that block id, holds its
whole 512 tokens, of which the partial one was a prefix, as driving.content makes them).

    python bench/turns_trace.py --out /tmp/turns.jsonl [--conversations 600] [--seed 0]

Prints the trace's size. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

BLOCK = 512


def conversations(n: int, seed: int, rate: float, system_prompts: int, system_share: float,
                  mean_turns: float, think: tuple[float, float]) -> list[dict]:
    rng = np.random.default_rng(seed)
    next_id = [0]

    def fresh(blocks: int) -> list[int]:
        ids = list(range(next_id[0], next_id[0] + blocks))
        next_id[0] += blocks
        return ids

    systems = [fresh(int(rng.integers(1, 9))) for _ in range(system_prompts)]
    rows, t = [], 0.0
    for _ in range(n):
        t += rng.exponential(1.0 / rate)
        blocks = list(systems[int(rng.integers(system_prompts))]) if rng.random() < system_share else []
        first = int(rng.integers(64, 6000))                        # the first message's tokens
        blocks += fresh(-(-first // BLOCK))
        turns = min(16, int(rng.geometric(1.0 / mean_turns)))   # (mean_turns 1: one turn each)
        at = t
        for k in range(turns):
            partial = int(rng.integers(1, BLOCK + 1))                # tokens of the last block used
            prompt = (len(blocks) - 1) * BLOCK + partial
            out = int(rng.integers(32, 1024))
            rows.append({"timestamp": int(at * 1000), "input_length": prompt, "output_length": out,
                         "hash_ids": list(blocks)})
            follow = int(rng.integers(16, 2000))
            blocks += fresh(-(-(out + follow) // BLOCK))               # its answer and the next message
            at += float(rng.uniform(*think))
    rows.sort(key=lambda r: r["timestamp"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--conversations", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate", type=float, default=1.0, help="conversations starting per second")
    ap.add_argument("--system-prompts", type=int, default=16)
    ap.add_argument("--system-share", type=float, default=0.7)
    ap.add_argument("--mean-turns", type=float, default=4.0)
    ap.add_argument("--think", default="20,120", help="seconds between a turn and the next: low,high")
    args = ap.parse_args()
    lo, hi = (float(x) for x in args.think.split(","))
    rows = conversations(args.conversations, args.seed, args.rate, args.system_prompts, args.system_share,
                         args.mean_turns, (lo, hi))
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    total = sum(r["input_length"] for r in rows)
    print(f"{len(rows):,} requests in {args.conversations:,} conversations, {total:,} prompt tokens over "
          f"{rows[-1]['timestamp'] / 1000:.0f} s (bench/prefix_vllm.py prints the most any cache could hit)")


if __name__ == "__main__":
    main()
