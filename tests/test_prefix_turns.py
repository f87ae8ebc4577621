"""A conversation's next turn resumes at the end of the previous turn's prompt (its last full
page) when the answer's pages are not keyed (a trace gives prompts only, or the engine finishes
without the generated ids): the cache keeps the resume point at the last full page boundary of
every prompt that continues cached pages (a conversation past its first turn), as a divergence
point (`keep_prompt_ends`, vLLM's replay boundary)."""

import numpy as np
import pytest

from kvatlas import allocate, plan
from kvatlas.errors import KvatlasError
from kvatlas.prefix import PrefixCache
from test_prefix_queue import run_request


def _cache(keep: bool):
    c = allocate(plan("tiny-v4", "64MiB", max_model_len=4096, max_running_requests=2, prefix_checkpoints=16,
                      chunked_prefill_tokens=1024))
    c.prefix.keep_prompt_ends = keep
    return c


def _turn(c, rid, prompt, out: int, keyed_output: bool) -> int:
    answer = np.arange(out) % 997
    return run_request(c, rid, prompt, out, np.concatenate((prompt, answer)) if keyed_output else prompt)


@pytest.mark.parametrize("keep", [True, False])
def test_the_next_turn_resumes_at_the_previous_prompts_last_full_page(keep):
    rng = np.random.default_rng(3)
    first = rng.integers(0, 1000, 1000)
    c = _cache(keep)
    assert _turn(c, "t1", first, 600, keyed_output=False) == 0   # its answer crosses 1,024, 1,280, 1,536
    second = np.concatenate((first, rng.integers(0, 1000, 700)))   # 6 full pages: the boundary at 1,536
    assert _turn(c, "t2", second, 600, keyed_output=False) == 0    # a first prompt's end is not kept
    points = [n.checkpoint for n in c.prefix.tree.nodes.values() if n.checkpoint is not None]
    assert [(p.boundary_tokens, p.divergence) for p in points if p.boundary_tokens == 1536] == \
        ([(1536, True)] if keep else [])     # a divergence point: evicted last
    third = np.concatenate((second, rng.integers(0, 1000, 100)))
    hit = _turn(c, "t3", third, 8, keyed_output=False)
    assert hit == (1536 if keep else 1024)  # without it: the policy's point at 1,024 (page 4, level 2)
    assert c.prefix.stats.hit_tokens == hit


def test_with_the_answer_keyed_the_next_turn_resumes_past_it_either_way():
    rng = np.random.default_rng(4)
    first = rng.integers(0, 1000, 1000)
    for keep in (True, False):
        c = _cache(keep)
        _turn(c, "t1", first, 600, keyed_output=True)
        second = np.concatenate((first, np.arange(600) % 997, rng.integers(0, 1000, 300)))
        assert _turn(c, "t2", second, 8, keyed_output=False) == 1536   # the end of what t1 wrote, in full pages


def test_the_flag_must_be_a_bool():
    c = allocate(plan("tiny-v4", "64MiB", max_model_len=4096, max_running_requests=2, prefix_checkpoints=16))
    with pytest.raises(KvatlasError, match="^keep_prompt_ends: 1 is not a boolean; give True or False"):
        PrefixCache(c.allocator, keep_prompt_ends=1)
