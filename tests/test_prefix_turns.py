"""A conversation's next turn resumes at the end of the previous turn's prompt (its last full
page) when the answer's pages are not keyed (a trace gives prompts only, or the engine finishes
without the generated ids): the cache keeps the resume point at every prompt's last full page
boundary (`keep_prompt_ends`, vLLM's replay boundary), as an intermediate point."""

import numpy as np
import pytest

from kvatlas import allocate, plan
from kvatlas.errors import KvatlasError
from kvatlas.prefix import PrefixCache


def _cache(keep: bool):
    c = allocate(plan("tiny-v4", "64MiB", max_model_len=4096, max_running_requests=2, prefix_checkpoints=16,
                      chunked_prefill_tokens=1024))
    c.prefix.keep_prompt_ends = keep
    return c


def _turn(c, rid, prompt, out: int, keyed_output: bool) -> int:
    adm = c.admit(rid, len(prompt), out, token_ids=prompt)
    done = adm.cached_tokens
    while done < len(prompt):
        n = min(1024, len(prompt) - done)
        c.extend(rid, n)
        done += n
    for _ in range(out):
        c.step([rid])
    answer = np.arange(out) % 997
    c.finish(rid, token_ids=np.concatenate((prompt, answer)) if keyed_output else prompt)
    c.check_integrity()
    return adm.cached_tokens


@pytest.mark.parametrize("keep", [True, False])
def test_the_next_turn_resumes_at_the_previous_prompts_last_full_page(keep):
    rng = np.random.default_rng(3)
    first = rng.integers(0, 1000, 1000)                 # 3 full pages: the boundary at 768
    c = _cache(keep)
    assert _turn(c, "t1", first, 600, keyed_output=False) == 0   # its answer crosses 1,024, 1,280, 1,536
    second = np.concatenate((first, rng.integers(0, 1000, 500)))
    hit = _turn(c, "t2", second, 8, keyed_output=False)
    assert hit == (768 if keep else 0)                  # without it the policy kept no point on those pages
    assert c.prefix.tree.nodes and c.prefix.stats.hit_tokens == hit


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
    with pytest.raises(KvatlasError, match="^keep_prompt_ends: 1 is not True or False; give a bool"):
        PrefixCache(c.allocator, keep_prompt_ends=1)


def test_a_continuing_prompts_end_is_a_divergence_point_a_first_prompts_is_not():
    """The point at a first turn's prompt end is intermediate (evicted first, by level); at the
    end of a prompt that continued a cached one (a later turn: likely to go on), a divergence
    point, evicted last."""
    rng = np.random.default_rng(5)
    first = rng.integers(0, 1000, 1000)
    c = _cache(True)
    _turn(c, "t1", first, 300, keyed_output=False)
    second = np.concatenate((first, rng.integers(0, 1000, 700)))     # 6 full pages: the boundary at 1,536
    assert _turn(c, "t2", second, 300, keyed_output=False) == 768
    points = {n.checkpoint.boundary_tokens: n.checkpoint for n in c.prefix.tree.nodes.values()
              if n.checkpoint is not None}
    assert not points[768].divergence and points[1536].divergence
    third = np.concatenate((second, rng.integers(0, 1000, 100)))
    assert _turn(c, "t3", third, 8, keyed_output=False) == 1536
