"""The decode workload of bench/vmm_gpu.py part (c) and bench/vmm_step_cpu.py: a request of
500-1,500 prompt tokens and 64-512 new ones, prefilled in chunks. Works on a KVCache or a bare
Allocator (both have admit/extend and a plan)."""

from __future__ import annotations


def prefill(target, rid, tokens: int) -> None:
    chunk = target.plan.options.chunked_prefill_tokens
    done = 0
    while done < tokens:
        n = min(chunk, tokens - done)
        target.extend(rid, n)
        done += n


def start_request(target, rid, rng) -> int:
    """Admit and prefill one request; return the length at which it finishes."""
    prompt, new = int(rng.integers(500, 1500)), int(rng.integers(64, 512))
    target.admit(rid, prompt, new)
    prefill(target, rid, prompt)
    return prompt + new
