"""The prefix cache verifies content, never trusts it: the ids given at finish must agree with the
prompt the request was admitted (and written) with, or nothing is published; keys given
precomputed are checked wherever the ids are known too.

The property test drives many interleaved requests with shared prompts, follow-up turns and
finish-time ids that are right, slipped (a BOS prepended, one id changed, re-tokenized, cut) or
random, and checks after every step that a hit only ever hands a request pages whose KV was
computed for exactly its prompt's content."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

import kvatlas  # noqa: E402
from kvatlas.prefix import page_keys  # noqa: E402
from kvatlas.errors import RequestStateError  # noqa: E402
from kvatlas.prefix.keys import ContentMismatchError  # noqa: E402

P = 256


def state(c):
    a = c.allocator
    return (c.ledger.snapshot(), len(c.prefix.tree.nodes), c.prefix.tree.checkpoints, dict(a.slot_of),
            a.length.tobytes(), a.full_table.tobytes())


def test_the_poisoning_of_the_report_is_refused_and_nothing_is_published():
    c = kvatlas.allocate(kvatlas.plan("tiny-v4", "128MiB", max_running_requests=4, prefix_checkpoints=16))
    ids, other = np.arange(900) % 5000, (np.arange(900) + 12345) % 5000
    c.admit("a", 600, 300, token_ids=ids[:600])
    c.extend("a", 600)
    for _ in range(300):
        c.step(["a"])
    before = state(c)
    with pytest.raises(ContentMismatchError, match="token_ids: page 0 differs from the prompt it was admitted"):
        c.finish("a", token_ids=other)
    # the prompt's two full pages were shared as written, under the admitted prompt's keys (issue
    # 34); the poisoned report publishes nothing more
    assert state(c) == before and len(c.prefix.tree.nodes) == 2
    c.check_integrity()
    assert c.admit("b", 800, 8, token_ids=other[:800]).cached_tokens == 0   # no hit on a's KV
    c.finish("a", token_ids=ids)                       # the true ids: a's pages are published
    assert c.admit("c", 800, 8, token_ids=ids[:800]).cached_tokens == 768
    c.check_integrity()


def _running_a(content):
    """Request "a" admitted with content(ids) as its keyword arguments, 600 + 100 tokens written."""
    c = kvatlas.allocate(kvatlas.plan("tiny-v4", "128MiB", max_running_requests=4, prefix_checkpoints=16),
                         backend="none")
    ids = np.random.default_rng(0).integers(0, 50_000, 1000)
    c.admit("a", 600, 300, **content(ids))
    c.extend("a", 600)
    for _ in range(100):
        c.step(["a"])
    return c, ids


@pytest.mark.parametrize("slip,where", [
    (lambda ids: np.concatenate(([0], ids))[:700], "page 0"),           # a BOS the prompt did not have
    (lambda ids: np.where(np.arange(len(ids)) == 300, ids + 1, ids)[:700], "page 1"),
    (lambda ids: np.where(np.arange(len(ids)) == 599, ids + 1, ids)[:700], "id 599"),   # the partial page
    (lambda ids: np.where(np.arange(len(ids)) == 530, ids + 1, ids)[:540], "id 530"),   # ids end early
    (lambda ids: ids[1:701], "page 0"),                                 # a dropped first token
    (lambda ids: np.where(np.arange(600) == 10, -1, ids[:600]), "page 0"),
])
def test_slipped_ids_are_refused_whatever_their_length(slip, where):
    c, ids = _running_a(lambda ids: {"token_ids": ids[:600]})
    before = state(c)
    with pytest.raises(ContentMismatchError, match=where):
        c.finish("a", token_ids=slip(ids))
    assert state(c) == before
    c.finish("a", token_ids=ids[:700])
    assert len(c.prefix.tree.nodes) == 2


def test_ids_that_agree_with_the_prompt_may_be_shorter_or_longer():
    c, ids = _running_a(lambda ids: {"token_ids": ids[:600]})
    c.finish("a", token_ids=ids[:550])     # finished mid-way through its record: the prompt's pages only
    assert len(c.prefix.tree.nodes) == 2


@pytest.mark.parametrize("ids", ["abc", 5, [[1, 2]], [1.5] * 700, None])
def test_finish_ids_that_are_not_ids(ids):
    c, _ = _running_a(lambda ids: {"token_ids": ids[:600]})
    before = state(c)
    if ids is None:
        c.finish("a", token_ids=ids)
        return
    with pytest.raises(kvatlas.KvatlasError, match="token_ids"):
        c.finish("a", token_ids=ids)
    assert state(c) == before


def test_page_keys_given_beside_token_ids_must_be_their_keys():
    c = kvatlas.allocate(kvatlas.plan("tiny-v4", "128MiB", max_running_requests=4, prefix_checkpoints=16),
                         backend="none")
    ids = np.arange(600)
    before = state(c)
    with pytest.raises(ContentMismatchError, match="page_keys: page 1 differs from the keys of token_ids"):
        c.admit("a", 600, 10, token_ids=ids, page_keys=np.array([page_keys(ids, P)[0], 12345], np.uint64))
    assert state(c) == before
    c.admit("a", 600, 10, token_ids=ids, page_keys=page_keys(ids, P))
    c.check_integrity()


def test_keys_of_another_scheme_are_caught_where_the_ids_are_given():
    c, ids = _running_a(lambda ids: {"page_keys": [11, 22]})     # trace replay with its own keys
    before = state(c)
    with pytest.raises(ContentMismatchError, match="token_ids: page 0"):
        c.finish("a", token_ids=ids[:700])
    assert state(c) == before
    c.finish("a")                                                # what they can publish: the prompt's pages
    assert sorted(c.prefix.tree.nodes) == [11, 22]


def test_content_never_given_at_admission_cannot_be_published_at_finish():
    c, ids = _running_a(lambda ids: {})
    before = state(c)
    with pytest.raises(ContentMismatchError, match="admitted without token_ids or page_keys"):
        c.finish("a", token_ids=ids[:700])
    assert state(c) == before
    c.finish("a")
    assert len(c.prefix.tree.nodes) == 0


# ------------------------------------------------------------------ property: never a foreign hit
SYSTEMS = [np.random.default_rng(s).integers(0, 7, 700) for s in range(3)]   # few ids: look-alikes abound


def checked(n_ids: int, prompt: int) -> np.ndarray:
    """Prompt positions that finish-time ids of length n_ids are checked at: the prompt's full
    pages they cover whole (by key), and its ids past the last full page (one by one). A page they
    cover in part is neither checked nor published from them."""
    full = prompt // P * P
    return np.concatenate((np.arange(min(n_ids // P * P, full)), np.arange(full, min(prompt, n_ids))))


def _slip(rng, truth, prompt_ids):
    """Finish-time ids and whether they contradict the prompt where it is checked (None: either)."""
    prompt = len(prompt_ids)
    kind = rng.integers(6)
    if kind == 0:
        return truth, False
    if kind == 1:   # a BOS the prompt did not have: every id moves (with 7 ids, it may still agree)
        x = np.concatenate(([6], truth))
        at = checked(len(x), prompt)
        return x, bool(np.any(x[at] != prompt_ids[at]))
    if kind == 2:
        at = checked(len(truth), prompt)
        if not len(at):
            return truth, False
        x = truth.copy()
        i = int(at[rng.integers(len(at))])
        x[i] = (x[i] + 1) % 7
        return x, True
    if kind == 3:
        return rng.integers(0, 7, int(rng.integers(1, len(truth) + 300))), None   # random: refused or lucky
    if kind == 4:
        return truth[: int(rng.integers(1, len(truth) + 1))], False
    return None, False


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_no_hit_ever_hands_out_kv_computed_for_other_content(seed):
    drive(seed)


def test_the_property_workload_does_hit():
    """Not vacuous: these seeds hit the cache, through prompts and through follow-up turns."""
    assert all(drive(seed) >= 2 for seed in (1, 2, 3))


def drive(seed) -> int:
    """Interleaved requests, integrity checked after every step; the number of admissions that hit."""
    rng = np.random.default_rng(seed)
    c = kvatlas.allocate(kvatlas.plan("tiny-v4", "24MiB", max_running_requests=4, max_model_len=2048,
                                      chunked_prefill_tokens=512, prefix_checkpoints=12), backend="none")
    a = c.allocator
    content: dict[int, bytes] = {}   # physical full page -> the ids its KV was computed for (as written)
    finished: list = []              # sequences of finished requests: follow-up turns repeat them
    running: dict = {}               # rid -> [truth ids (prompt + generated), prompt, written]
    hits = 0
    for n in range(60):
        op = rng.random()
        if op < 0.3 and len(running) < 4:
            base = finished[rng.integers(len(finished))] if finished and rng.random() < 0.5 \
                else SYSTEMS[rng.integers(3)][: int(rng.integers(100, 700))]
            prompt_ids = np.concatenate((base, rng.integers(0, 7, int(rng.integers(1, 300)))))[:1500]
            out = int(rng.integers(1, 400))
            if not c.can_admit(len(prompt_ids), out, token_ids=prompt_ids):
                continue
            adm = c.admit(n, len(prompt_ids), out, token_ids=prompt_ids)
            slot = a.slot_of[n]
            for i in range(adm.cached_tokens // P):   # the property: hit pages hold exactly this prompt
                assert content[int(a.full_table[slot, i])] == prompt_ids[i * P:(i + 1) * P].tobytes()
            hits += adm.cached_tokens > 0
            truth = np.concatenate((prompt_ids, rng.integers(0, 7, out)))
            running[n] = [truth, len(prompt_ids), adm.cached_tokens]
        elif op < 0.75 and running:
            rid = list(running)[rng.integers(len(running))]
            truth, prompt, written = running[rid]
            k = min(prompt - written, 512) if written < prompt else min(1, len(truth) - written)
            if k:
                c.extend(rid, k) if written < prompt else c.step([rid])
                running[rid][2] += k
                slot = a.slot_of[rid]   # its own full pages hold its ids (shared as written: others may read them now)
                content.update({int(a.full_table[slot, i]): truth[i * P:(i + 1) * P].tobytes()
                                for i in range(int(a.full_shared[slot]), (written + k) // P)})
        elif running:
            rid = list(running)[rng.integers(len(running))]
            truth, prompt, written = running[rid]
            ids, wrong = _slip(rng, truth[:written + 1], truth[:prompt])
            slot = a.slot_of[rid]
            mine = {int(a.full_table[slot, i]): truth[i * P:(i + 1) * P].tobytes()
                    for i in range(int(a.full_shared[slot]), written // P)}
            try:
                c.finish(rid, token_ids=ids)
            except ContentMismatchError:
                assert wrong is not False, "ids that agree with the prompt were refused"
                c.finish(rid)   # nothing was published; finish without ids
            else:
                assert wrong is not True, "ids that contradict the prompt were accepted"
            content.update(mine)
            finished.append(truth[:written])
            del running[rid]
        c.check_integrity()
    return hits


# ------------------------------------------------------------------ copy_contents moves what the pages hold

def two_prefilled(seed, share_as_written):
    """A cache with requests A and B, two prompts of 600 tokens, prefilled (pages shared as they are
    written, or at finish, where two prompts' pages may be copied)."""
    c = kvatlas.allocate(kvatlas.plan("tiny-v4", "128MiB", max_running_requests=4, prefix_checkpoints=16))
    c.prefix.share_as_written = share_as_written
    rng = np.random.default_rng(seed)
    prompts = {"A": rng.integers(0, 50_000, 600), "B": rng.integers(0, 50_000, 600)}
    for rid, p in prompts.items():
        c.admit(rid, 600, 8, token_ids=p)
        c.extend(rid, 600)
    return c, prompts


@pytest.mark.parametrize("ids", [True, False], ids=["finish with B's ids", "finish without ids"])
def test_copy_contents_then_finish_publishes_nothing_under_the_destinations_keys(ids):
    """Issue 33, the reported sequence: A and B, two prompts, prefilled; copy_contents(["A"],
    ["B"]) gives B A's KV. finish("B", token_ids=B's ids) was accepted (the ids agree with what
    B was admitted with) and published A's KV under B's keys, as did finish("B") without ids:
    a later request with B's prompt hit 512 tokens of A's KV. Now B's ids are refused with
    nothing changed, and what B publishes goes under A's keys, the content its pages hold."""
    c, prompts = two_prefilled(33, share_as_written=False)
    c.copy_contents(["A"], ["B"])
    c.check_integrity()
    if ids:
        before = state(c)
        with pytest.raises(ContentMismatchError, match="token_ids: page 0 differs from the prompt it was admitted"):
            c.finish("B", token_ids=prompts["B"])
        assert state(c) == before
        c.finish("B", token_ids=prompts["A"])
    else:
        c.finish("B")
    assert sorted(c.prefix.tree.nodes) == sorted(page_keys(prompts["A"], P).tolist())
    c.finish("A", token_ids=prompts["A"])
    c.check_integrity()
    assert c.admit("B again", 600, 1, token_ids=prompts["B"]).cached_tokens == 0
    assert c.admit("A again", 600, 1, token_ids=prompts["A"]).cached_tokens == 512


def test_copy_contents_of_two_prompts_shared_as_written_is_refused_with_nothing_changed():
    """The same sequence with pages shared as they are written (the default): A's and B's prompt
    pages are in the cache already, each under its own prompt's keys, so B cannot take A's content
    (its cached pages would hold other content than their keys): refused, nothing changed, and
    each prompt's later hit reads its own pages."""
    c, prompts = two_prefilled(33, share_as_written=True)
    first = {rid: int(c.allocator.full_table[c.allocator.slot_of[rid], 0]) for rid in prompts}
    before = state(c)
    with pytest.raises(RequestStateError, match="reading the same cached pages in each pair"):
        c.copy_contents(["A"], ["B"])
    assert state(c) == before
    c.finish("B", token_ids=prompts["B"])
    c.finish("A", token_ids=prompts["A"])
    c.check_integrity()
    for rid in ("A", "B"):
        adm = c.admit(f"{rid} again", 600, 1, token_ids=prompts[rid])
        assert adm.cached_tokens == 512
        assert int(c.allocator.full_table[c.allocator.slot_of[f"{rid} again"], 0]) == first[rid]


def test_copy_contents_then_finish_never_publishes_kv_under_the_destinations_prompt():
    """Issue 33: B takes over A's pages (copy_contents), so B's pages hold A's content. Finishing B
    with B's own ids must not publish A's KV under B's keys: those ids are refused with nothing
    changed, B's pages publish under A's keys (what they hold), and the resume points B saved
    from its own content are not published. Both are decoding past boundary 512, its resume
    point captured, its SWA tail still in their windows."""
    from prefix_model import assert_same_reads
    from prefix_session import Session, make_plan

    s = Session(make_plan(0))
    s.hot.prefix.share_as_written = False   # pages shared at finish: two prompts' pages may be copied
    rng = np.random.default_rng(5)
    a_seq, b_seq = rng.integers(0, 50_000, 600), rng.integers(0, 50_000, 600)
    for seq in (a_seq, b_seq):
        s.admit(seq, 500, 100)
    for rid in ("r0", "r1"):
        for n in (256, 244):
            s.extend(rid, n)
    for _ in range(40):
        for rid in ("r0", "r1"):
            s.step(rid, 1, 1)
    for c in (s.hot, s.cold):
        c.copy_contents(["r0"], ["r1"])
    s.running["r1"] = s.running["r0"]   # the twins' record of what r1 holds
    s.check("after copy_contents")
    assert_same_reads(s.mh.reads("r1"), s.mh.reads("r0"), "r1 reads what r0 reads")   # its whole window too
    before = state(s.hot)
    with pytest.raises(ContentMismatchError, match="token_ids: page 0 differs from the prompt it was admitted"):
        s.hot.finish("r1", token_ids=b_seq[:540])
    assert state(s.hot) == before and len(s.hot.prefix.tree.nodes) == 0
    s.hot.check_integrity()
    s.hot.finish("r1", token_ids=a_seq[:540])   # what its pages hold
    s.cold.finish("r1")
    del s.running["r1"]
    assert sorted(s.hot.prefix.tree.nodes) == sorted(page_keys(a_seq[:540], P).tolist())
    s.finish("r0")
    # nothing is cached under B's keys; A's content is, and a hit on it reads what a cold run reads
    assert s.hot.admit("b again", 500, 1, token_ids=b_seq[:500]).cached_tokens == 0
    s.hot.finish("b again")
    s.admit(a_seq, 530, 1)
    assert s.hits == 1
    s.check("a hit on A's content")


def test_a_swap_of_two_requests_swaps_what_each_may_publish():
    """copy_contents(["A", "B"], ["B", "A"]): each now holds the other's content, so each
    publishes under the other's prompt keys (the property test found a swap giving both A's)."""
    c, prompts = two_prefilled(34, share_as_written=False)
    c.copy_contents(["A", "B"], ["B", "A"])
    with pytest.raises(ContentMismatchError):
        c.finish("A", token_ids=prompts["A"])
    c.finish("A", token_ids=prompts["B"])
    assert sorted(c.prefix.tree.nodes) == sorted(page_keys(prompts["B"], P).tolist())
    c.finish("B")
    assert sorted(c.prefix.tree.nodes) == sorted(page_keys(prompts["A"], P).tolist() + page_keys(prompts["B"], P).tolist())
    c.check_integrity()
