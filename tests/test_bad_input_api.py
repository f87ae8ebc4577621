"""Bad input through the Python API: every case raises a KvatlasError (a ValueError) whose one-line
message names the field, and the cache it was tried on still passes its integrity check with a
ledger snapshot and allocator state exactly as before.

The cache has running requests in several states (prefilling, decoding, with drafts in flight)
so lookups, rollbacks and steps are refused against real state, not an empty cache."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvatlas  # noqa: E402
from kvatlas import KvatlasError  # noqa: E402
from kvatlas.observing import server  # noqa: E402

NAN = float("nan")


class Unhashable:
    __hash__ = None


@pytest.fixture(scope="module")
def cache():
    p = kvatlas.plan("tiny-v4", "64MiB", max_running_requests=4, max_model_len=2048,
                     chunked_prefill_tokens=512, draft_tokens=2)
    c = kvatlas.allocate(p)
    c.admit("a", 300, 40)
    c.extend("a", 300)
    c.admit(7, 100, 10)
    c.extend(7, 100)
    c.admit(("t", 1), 600, 20)
    c.extend(("t", 1), 256)
    c.step(["a", 7], 3)   # drafts in flight: rollback is legal for up to 3 tokens
    return c


def fingerprint(c):
    a = c.allocator
    arrays = [a.length, a.full_held, a.reserved, a.swa_lo, a.swa_hi, a.full_table, a.swa_table, a.last_write,
              a.slots.owner]
    return (tuple(x.tobytes() for x in arrays), a.outstanding, dict(a.slot_of), a._epoch)


R = "a"   # a running request
LIFECYCLE = [
    # admit: ids
    ("admit", (None, 10), "request_id"), ("admit", (NAN, 10), "request_id"), ("admit", (np.float64("nan"), 10), "request_id"),
    ("admit", ([1], 10), "request_id"), ("admit", ({"x": 1}, 10), "request_id"), ("admit", ({1}, 10), "request_id"),
    ("admit", (Unhashable(), 10), "request_id"), ("admit", (bytearray(b"x"), 10), "request_id"),
    ("admit", (R, 10), "request_id"), ("admit", (7, 10), "request_id"),
    # admit: lengths
    ("admit", ("n", 0), "prompt_tokens"), ("admit", ("n", -1), "prompt_tokens"), ("admit", ("n", 1.5), "prompt_tokens"),
    ("admit", ("n", 10.0), "prompt_tokens"), ("admit", ("n", "10"), "prompt_tokens"), ("admit", ("n", True), "prompt_tokens"),
    ("admit", ("n", None), "prompt_tokens"), ("admit", ("n", NAN), "prompt_tokens"), ("admit", ("n", math.inf), "prompt_tokens"),
    ("admit", ("n", 10**40), "prompt_tokens"), ("admit", ("n", np.float32(5)), "prompt_tokens"),
    ("admit", ("n", [5]), "prompt_tokens"), ("admit", ("n", 10, -1), "max_new_tokens"),
    ("admit", ("n", 10, 1.5), "max_new_tokens"), ("admit", ("n", 10, "5"), "max_new_tokens"),
    ("admit", ("n", 10, NAN), "max_new_tokens"), ("admit", ("n", 10, 10**30), "max_new_tokens"),
    ("admit", ("n", 10, False), "max_new_tokens"), ("admit", ("n", 2000, 100), "max_model_len"),
    ("admit", ("n", 2049), "max_model_len"),
    ("can_admit", (0,), "prompt_tokens"), ("can_admit", (NAN,), "prompt_tokens"), ("can_admit", ("5",), "prompt_tokens"),
    ("can_admit", (5, -2), "max_new_tokens"), ("can_admit", (5, math.inf), "max_new_tokens"),
    # extend
    ("extend", ("zz", 5), "request_id"), ("extend", (None, 5), "request_id"), ("extend", ([1], 5), "request_id"),
    ("extend", (NAN, 5), "request_id"), ("extend", (R, 0), "num_tokens"), ("extend", (R, -3), "num_tokens"),
    ("extend", (R, 1.5), "num_tokens"), ("extend", (R, "5"), "num_tokens"), ("extend", (R, True), "num_tokens"),
    ("extend", (R, None), "num_tokens"), ("extend", (R, NAN), "num_tokens"), ("extend", (R, 10**20), "num_tokens"),
    ("extend", (R, 513), "num_tokens"), ("extend", (("t", 1), 513), "num_tokens"),
    # step
    ("step", ("a",), "request_ids"), ("step", (b"a",), "request_ids"), ("step", (5,), "request_ids"),
    ("step", (None,), "request_ids"), ("step", (["zz"],), "request_id"), ("step", ([None],), "request_id"),
    ("step", ([[1]],), "request_id"), ("step", ([R, R],), "request_ids"), ("step", ([R], 0), "tokens_each"),
    ("step", ([R], -1), "tokens_each"), ("step", ([R], 4), "tokens_each"), ("step", ([R], [1.5]), "tokens_each"),
    ("step", ([R], ["1"]), "tokens_each"), ("step", ([R], [1, 2]), "tokens_each"), ("step", ([R], [[1]]), "tokens_each"),
    ("step", ([R, 7], [1, 0]), "tokens_each"), ("step", ([R, 7], [1, 9]), "tokens_each"),
    ("step", ([R], 1.0), "tokens_each"), ("step", ([R], "1"), "tokens_each"), ("step", ([R], None), "tokens_each"),
    ("batch", ("a",), "request_ids"), ("batch", (3,), "request_ids"), ("batch", (["zz"],), "request_id"),
    # rollback
    ("rollback", (R, -1), "num_tokens"), ("rollback", (R, 4), "num_tokens"), ("rollback", (R, 1.5), "num_tokens"),
    ("rollback", (R, True), "num_tokens"), ("rollback", (R, "1"), "num_tokens"), ("rollback", (R, None), "num_tokens"),
    ("rollback", (R, NAN), "num_tokens"), ("rollback", ("zz", 1), "request_id"), ("rollback", (None, 1), "request_id"),
    ("rollback", ([1], 1), "request_id"), ("rollback", (("t", 1), 1), "num_tokens"),
    # finish and usage
    ("finish", ("zz",), "request_id"), ("finish", (None,), "request_id"), ("finish", ([1],), "request_id"),
    ("finish", (NAN,), "request_id"), ("finish", ({},), "request_id"), ("finish", (Unhashable(),), "request_id"),
    ("request_usage", ("zz",), "request_id"), ("request_usage", ([1],), "request_id"),
    ("request_usage", (None,), "request_id"),
]


@pytest.mark.parametrize("method,args,field", LIFECYCLE, ids=[f"{m}{a!r}"[:50] for m, a, _ in LIFECYCLE])
def test_lifecycle_call_refused_and_nothing_changes(cache, method, args, field):
    before_snap, before = cache.ledger.snapshot(), fingerprint(cache)
    with pytest.raises(KvatlasError) as exc:
        getattr(cache, method)(*args)
    msg = str(exc.value)
    assert field in msg and "\n" not in msg, msg
    assert cache.ledger.snapshot() == before_snap
    assert fingerprint(cache) == before
    cache.check_integrity()


PLAN = [
    ({"memory_bytes": -1}, "memory"), ({"memory_bytes": 0}, "memory"), ({"memory_bytes": "abc"}, "memory"),
    ({"memory_bytes": 1.5}, "memory_bytes"), ({"memory_bytes": NAN}, "memory_bytes"), ({"memory_bytes": True}, "memory"),
    ({"memory_bytes": 2**70}, "memory_bytes"), ({"memory_bytes": "9" * 400}, "memory"), ({"memory_bytes": [1]}, "memory"),
    ({"online_c128": "no"}, "online_c128"), ({"online_c128": 1}, "online_c128"), ({"online_c128": None}, "online_c128"),
    ({"draft_layers": "on"}, "draft_layers"), ({"draft_layers": 0}, "draft_layers"),
    ({"mem_fraction": NAN, "memory_bytes": None}, "mem_fraction"), ({"mem_fraction": 0}, "mem_fraction"),
    ({"mem_fraction": "0.9"}, "mem_fraction"), ({"mem_fraction": math.inf}, "mem_fraction"),
    ({"max_running_requests": 1.5}, "max_running_requests"), ({"max_running_requests": 0}, "max_running_requests"),
    ({"max_running_requests": "4"}, "max_running_requests"), ({"max_running_requests": 2**40}, "max_running_requests"),
    ({"max_model_len": 0}, "max_model_len"), ({"max_model_len": NAN}, "max_model_len"), ({"tp": 0}, "tp"),
    ({"pp": True}, "pp"), ({"dp": -1}, "dp"), ({"pp_rank": 1}, "pp_rank"), ({"draft_tokens": -1}, "draft_tokens"),
    ({"page_tokens": 100}, "page_tokens"), ({"swa_page_tokens": 65}, "swa_page_tokens"),
    ({"chunked_prefill_tokens": 0.5}, "chunked_prefill_tokens"), ({"kv_layout": 5}, "kv_layout"),
    ({"kv_layout": ["v4"]}, "kv_layout"), ({"indexer": {}}, "indexer"), ({"state_dtype": None}, "state_dtype"),
    ({"gpu": ["h200"]}, "gpu"), ({"gpu": "a100"}, "gpu"), ({"weights_bytes": -5}, "weights"),
    ({"frobnicate": 1}, "frobnicate"), ({"kv_layout": "v4.1"}, "kv_layout"),
]


# ================================================================== round two
# Deployments that cannot exist and budgets too small because of one option: the refusal names
# the Python argument (never a CLI flag) and, for the budget, the one that made it too big.
PLAN_TWO = [
    ({"pp": 7}, "pp"), ({"pp": 100}, "pp ≤ 6"), ({"tp": 3}, "tp"), ({"tp": 8}, "4 attention heads"), ({"tp": 1024}, "tp"),
    ({"dp": 5}, "dp"), ({"dp": 100_000}, "max_running_requests=4"), ({"max_model_len": 4097}, "max_model_len"),
    ({"max_model_len": 100_000}, "max_position_embeddings 4,096"), ({"weights_bytes": "1GiB"}, "weights_bytes"),
    ({"weights_bytes": 5}, "memory_bytes"), ({"mem_fraction": 0.5}, "mem_fraction"), ({"mem_fraction": 0.9}, "mem_fraction"),
    ({"gpu": "h100", "memory_bytes": "200GiB"}, "memory_bytes"), ({"gpu": "b200", "memory_bytes": "1TiB"}, "b200"),
    ({"gpu": "h20", "memory_bytes": "120GiB"}, "gpu=h200"),
    ({"draft_tokens": 100_000}, "draft_tokens=100000 makes it too big"),
    ({"chunked_prefill_tokens": 2 * 10**9}, "chunked_prefill_tokens=2000000000 makes"),
    ({"prefix_checkpoints": 10**6}, "lower prefix_checkpoints to"), ({"swa_page_tokens": 4096}, "lower swa_page_tokens to"),
    ({"page_tokens": 2**20}, "lower page_tokens to"), ({"max_running_requests": 1000}, "lower max_running_requests to 16"),
    ({"max_running_requests": 1000, "max_model_len": 4096, "memory_bytes": "1MiB"}, "memory_bytes"),
]



@pytest.mark.parametrize("options,field", PLAN + PLAN_TWO, ids=[repr(o)[:40] for o, _ in PLAN + PLAN_TWO])
def test_plan_options_refused(options, field):
    opts = {"memory_bytes": "64MiB", "max_running_requests": 4, **options}
    memory = opts.pop("memory_bytes")
    with pytest.raises(KvatlasError) as exc:
        kvatlas.plan("tiny-v4", memory, **opts)
    msg = str(exc.value)
    assert field in msg and "\n" not in msg and "--" not in msg, msg   # Python's names in Python


@pytest.mark.parametrize("model", [None, 5, "", "nope", b"tiny-v4", ["tiny-v4"], "a\0b"])
def test_load_model_refuses(model):
    with pytest.raises(KvatlasError) as exc:
        kvatlas.load_model(model)
    assert "model" in str(exc.value)


@pytest.mark.parametrize("kw,field", [({"num_requests": 0}, "num_requests"), ({"num_requests": 1.5}, "num_requests"),
                                      ({"context_tokens": -1}, "context_tokens"),
                                      ({"context_tokens": "8"}, "context_tokens")])
def test_budget_for_refuses(kw, field):
    args = {"num_requests": 2, "context_tokens": 1024, **kw}
    with pytest.raises(KvatlasError) as exc:
        kvatlas.budget_for("tiny-v4", args["num_requests"], args["context_tokens"])
    assert field in str(exc.value)


@pytest.mark.parametrize("host", ["", " ", None, 5, "10.1.2.3", "::", "host.example"])
def test_server_start_refuses_a_host_that_exposes_it(cache, host):
    with pytest.raises(KvatlasError) as exc:
        server.start(cache, host=host, port=0)
    assert "host" in str(exc.value)


@pytest.mark.parametrize("port", [-1, 65536, 1.5, "80", True])
def test_server_start_refuses_a_bad_port(cache, port):
    with pytest.raises(KvatlasError) as exc:
        server.start(cache, port=port)
    assert "port" in str(exc.value)


def test_zero_zero_zero_zero_is_allowed_with_a_warning():
    assert "no authentication" in server.check_host("0.0.0.0")
    assert server.check_host("127.0.0.1") is None and server.check_host("::1") is None
    assert server.check_host("localhost") is None and server.check_host("127.0.0.5") is None


@pytest.fixture(scope="module")
def small_plan():
    return kvatlas.plan("tiny-v4", "64MiB", max_running_requests=4)


@pytest.fixture(scope="module")
def prefix_cache():
    """A prefix cache with requests running: one admitted with its ids (partly decoded), one
    admitted without content, one with keys of another scheme."""
    c = kvatlas.allocate(kvatlas.plan("tiny-v4", "128MiB", max_running_requests=4, prefix_checkpoints=8),
                         backend="none")
    ids = np.arange(1000) % 997
    c.admit("ids", 600, 100, token_ids=ids[:600])
    c.extend("ids", 600)
    for _ in range(20):
        c.step(["ids"])
    c.admit("bare", 300, 10)
    c.extend("bare", 300)
    c.admit("keys", 600, 10, page_keys=[11, 22])
    c.extend("keys", 300)
    c.ids = ids
    return c


def prefix_fingerprint(c):
    tree = c.prefix.tree
    return (fingerprint(c), c.ledger.snapshot(), len(tree.nodes), tree.checkpoints, tree.idle_pages,
            dict(c.prefix.stats.as_dict()), c.host)


IDS = np.arange(1000) % 997
PREFIX_CALLS = [
    # finish-time ids that are not ids, or contradict the admitted prompt: nothing is published
    ("finish", ("ids",), {"token_ids": "abc"}, "token_ids"), ("finish", ("ids",), {"token_ids": 5}, "token_ids"),
    ("finish", ("ids",), {"token_ids": [[1, 2]]}, "token_ids"), ("finish", ("ids",), {"token_ids": [1.5] * 700}, "token_ids"),
    ("finish", ("ids",), {"token_ids": [None] * 700}, "token_ids"),
    ("finish", ("ids",), {"token_ids": (IDS + 1) % 997}, "page 0 differs"),
    ("finish", ("ids",), {"token_ids": np.concatenate(([1], IDS))}, "page 0 differs"),   # a BOS slipped in
    ("finish", ("ids",), {"token_ids": np.where(np.arange(1000) == 555, 0, IDS)}, "id 555 differs"),
    ("finish", ("ids",), {"token_ids": np.where(np.arange(1000) == 300, 0, IDS)[:620]}, "page 1 differs"),
    ("finish", ("bare",), {"token_ids": IDS[:310]}, "admitted without token_ids or page_keys"),
    ("finish", ("keys",), {"token_ids": IDS[:700]}, "page 0 differs"),
    # content given at admission that is not content, or disagrees with itself
    ("admit", ("n", 300), {"token_ids": "abc"}, "token_ids"), ("admit", ("n", 300), {"token_ids": np.zeros((2, 300), int)}, "token_ids"),
    ("admit", ("n", 300), {"token_ids": np.zeros(300)}, "token_ids"), ("admit", ("n", 300), {"token_ids": [None] * 300}, "token_ids"),
    ("admit", ("n", 300), {"token_ids": IDS[:10]}, "token_ids"), ("admit", ("n", 300), {"page_keys": "abc"}, "page_keys"),
    ("admit", ("n", 600), {"page_keys": np.zeros((2, 1), int)}, "page_keys"), ("admit", ("n", 300), {"page_keys": [1, 2]}, "page_keys"),
    ("admit", ("n", 600), {"token_ids": IDS[:600], "page_keys": np.array([1, 2], np.uint64)}, "page_keys: page 0 differs"),
    ("can_admit", (300,), {"token_ids": "abc"}, "token_ids"), ("can_admit", (600,), {"page_keys": [1, 2, 3]}, "page_keys"),
    ("layer_pools", (99,), {}, "layer"), ("layer_pools", (-1,), {}, "layer"), ("layer_pools", ("x",), {}, "layer"),
    ("layer_pools", (None,), {}, "layer"), ("layer_pools", ([],), {}, "layer"), ("layer_pools", (2.5,), {}, "layer"),
]


@pytest.mark.parametrize("method,args,kw,field", PREFIX_CALLS, ids=[f"{m}{a!r}{list(k)}"[:50] for m, a, k, _ in PREFIX_CALLS])
def test_prefix_and_lookup_calls_refused_and_nothing_changes(prefix_cache, method, args, kw, field):
    before = prefix_fingerprint(prefix_cache)
    with pytest.raises(KvatlasError) as exc:
        getattr(prefix_cache, method)(*args, **kw)
    msg = str(exc.value)
    assert field in msg and "\n" not in msg, msg
    assert prefix_fingerprint(prefix_cache) == before
    prefix_cache.check_integrity()
    if method == "layer_pools":
        assert isinstance(exc.value, KeyError)   # what the lookup raised before: callers catching it still do


def _entries():
    """(id, call(plan, cache), the argument its refusal must name) for the boundary of every
    public entry point that takes an object or a size."""
    from kvatlas.datapath import PageGeometry, store
    from kvatlas.driving.traces import iter_trace, read_trace
    from kvatlas.planning.capacity import capacity, plan_to_dict
    from kvatlas.planning.hostplan import plan_host
    from kvatlas.prefix import page_keys
    spec = kvatlas.load_model("tiny-v4")

    def null_store(slots):
        def call(p, c):
            pool = c.pools["swa_kv"]
            geom = PageGeometry(kvatlas.formats.FP8_DS_MLA, pool.spec.entries_per_unit)
            store(geom, pool.tensor, 0, torch.tensor(slots), torch.zeros(len(slots), 512).bfloat16())
        return call
    out = [(f"plan({m!r})", lambda p, c, m=m: kvatlas.plan(m, "1GiB"), "model")
           for m in (None, 5, 1.5, b"tiny-v4", ["tiny-v4"])]
    out += [("plan({})", lambda p, c: kvatlas.plan({}, "1GiB"), "config.compress_ratios")]   # a parsed config.json
    out += [(f"budget_for({m!r})", lambda p, c, m=m: kvatlas.budget_for(m, 2, 100), "model") for m in (None, 5)]
    out += [(f"budget_for(n={n!r})", lambda p, c, n=n: kvatlas.budget_for("tiny-v4", n, 100), "num_requests")
            for n in (True, None, "2", 2.5, -1)]
    out += [(f"budget_for(ctx={n!r})", lambda p, c, n=n: kvatlas.budget_for("tiny-v4", 2, n), "context_tokens")
            for n in (True, None, 1.5, 0)]
    out += [(f"max_concurrency({x!r:.20})", lambda p, c, x=x: kvatlas.max_concurrency(x, 4096), "plan")
            for x in ("x", None, spec)]
    out += [(f"max_concurrency(p, {n!r})", lambda p, c, n=n: kvatlas.max_concurrency(p, n), "context_tokens")
            for n in (-5, 0, 1.5, None, "4096", True, 2**40)]
    out += [(f"allocate({x!r:.20})", lambda p, c, x=x: kvatlas.allocate(x), "plan") for x in ("not a plan", None, 5, spec, {})]
    out += [(f"allocate(backend={b!r})", lambda p, c, b=b: kvatlas.allocate(p, backend=b), "backend")
            for b in (None, 5, ["plain"], "mmap")]
    out += [(f"allocate(device={d!r})", lambda p, c, d=d: kvatlas.allocate(p, device=d), "device") for d in ("tpu", 5, "cuda:x")]
    out += [("allocate(bogus=1)", lambda p, c: kvatlas.allocate(p, bogus=1), "bogus")]
    out += [(f"{f.__name__}({x!r})", lambda p, c, f=f, x=x: f(x), "plan") for f in (capacity, plan_to_dict) for x in ("x", None)]
    out += [(f"plan_host({x!r})", lambda p, c, x=x: plan_host(x, "1GiB"), "plan") for x in ("x", None)]
    out += [(f"server.start({x!r:.20})", lambda p, c, x=x: server.start(p if x == "plan" else x, port=0), "cache")
            for x in ("x", None, "plan", 5)]
    out += [("server.start(empty collector)", lambda p, c: server.start(server.KvatlasCollector(), port=0), "cache")]
    out += [(f"KvatlasCollector({x!r})", lambda p, c, x=x: server.KvatlasCollector(p if x == "plan" else x), "cache")
            for x in ("x", "plan", 5)]
    out += [(f"KvatlasCollector(c, {kw})", lambda p, c, kw=kw: server.KvatlasCollector(c, **kw), f) for kw, f in (
        ({"tp_rank": -1}, "tp_rank"), ({"tp_rank": "x"}, "tp_rank"), ({"tp_rank": 1.5}, "tp_rank"),
        ({"dp_rank": True}, "dp_rank"), ({"gpu": 3}, "gpu"))]
    out += [(f"plan.buffer({n!r})", lambda p, c, n=n: p.buffer(n), "name") for n in ("x", None)]
    out += [(f"page_keys(P={pt!r})", lambda p, c, pt=pt: page_keys(np.arange(600), pt), "page_tokens") for pt in (0, -1, 1.5, None)]
    out += [(f"page_keys({t!r})", lambda p, c, t=t: page_keys(t, 256), "token_ids") for t in ("abc", [[1]], [1.5])]
    out += [(f"store(slots={s})", null_store(s), "slots") for s in ([0], [5, 0], [63, 64])]
    out += [(f"read_trace({x!r})", lambda p, c, x=x: read_trace(x), "workload") for x in (None, 5.5, "/dev/zero", [], "/dev/null")]
    out += [("iter_trace(fmt=5)", lambda p, c: list(iter_trace("x", fmt=5)), "trace_format"),
            ("audit(bogus=1)", lambda p, c: kvatlas.audit(c, bogus=1), "bogus")]
    return out


ENTRIES = _entries()


@pytest.mark.parametrize("call,field", [e[1:] for e in ENTRIES], ids=[e[0] for e in ENTRIES])
def test_every_public_entry_checks_its_arguments(small_plan, cache, call, field):
    """A KvatlasError naming the argument, in one line, never a raw AttributeError, TypeError or
    KeyError from inside; the cache passed along is left exactly as it was."""
    before, snap = fingerprint(cache), cache.ledger.snapshot()
    with pytest.raises(KvatlasError) as exc:
        call(small_plan, cache)
    assert field in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
    assert fingerprint(cache) == before and cache.ledger.snapshot() == snap
    assert cache.pools["swa_kv"].tensor[0].count_nonzero() == 0   # the null page: never written
    cache.check_integrity()


@pytest.fixture(scope="module")
def tiered():
    """(a prefix cache without a host tier, one with, its link, a cache without a prefix cache)."""
    from kvatlas.tiers import attach_host_tier
    plan = kvatlas.plan("tiny-v4", "128MiB", max_running_requests=4, prefix_checkpoints=8)
    free, linked = kvatlas.allocate(plan), kvatlas.allocate(plan)
    link = attach_host_tier(linked, "16MiB")
    yield free, linked, link, kvatlas.allocate(kvatlas.plan("tiny-v4", "64MiB", max_running_requests=4))
    linked.close()


FREE, LINKED, BARE = (lambda t: t[0]), (lambda t: t[1]), (lambda t: t[3])


def _attach(target, *args, **kw):
    """attach_host_tier on `target`: one of the fixture's caches (a selector) or any object."""
    from kvatlas.tiers import attach_host_tier
    return lambda t: attach_host_tier(target(t) if callable(target) else target, *args, **kw)


HOST_CALLS = [
    ("cache='x'", _attach("x", "64MiB"), "cache"), ("cache=5", _attach(5, "64MiB"), "cache"),
    ("bogus=1", _attach(FREE, "64MiB", bogus=1), "bogus"), ("4TiB", _attach(FREE, "4TiB"), "available"),
    ("None", _attach(FREE, None), "host_memory_bytes"), ("'0'", _attach(FREE, "0"), "host_memory_bytes"),
    ("-1", _attach(FREE, -1), "host_memory_bytes"), ("1KiB", _attach(FREE, "1KiB"), "host_memory_bytes"),
    ("nan", _attach(FREE, NAN), "host_memory_bytes"), ("share=2", _attach(FREE, "16MiB", checkpoint_share=2), "checkpoint_share"),
    ("share='x'", _attach(FREE, "16MiB", checkpoint_share="x"), "checkpoint_share"),
    ("staging='x'", _attach(FREE, "16MiB", staging_bytes="x"), "staging_bytes"),
    ("no prefix cache", _attach(BARE, "16MiB"), "prefix_checkpoints"),
    ("a second tier", _attach(LINKED, "16MiB"), "a host tier is attached already"),
    *[(f"prefetch({n!r})", lambda t, n=n: t[2].prefetch(n), "prompt_tokens") for n in (NAN, 0, -1, "5", None, 1.5, 10**12, True)],
    ("prefetch(token_ids='abc')", lambda t: t[2].prefetch(300, token_ids="abc"), "token_ids"),
    ("prefetch(page_keys='abc')", lambda t: t[2].prefetch(300, page_keys="abc"), "page_keys"),
    ("prefetch(short ids)", lambda t: t[2].prefetch(300, token_ids=np.arange(10)), "token_ids"),
]


@pytest.mark.parametrize("call,field", [h[1:] for h in HOST_CALLS], ids=[h[0] for h in HOST_CALLS])
def test_host_tier_arguments_refused_before_any_memory(tiered, call, field):
    free, linked, link, bare = tiered
    snap = link.snapshot()
    with pytest.raises(KvatlasError) as exc:
        call(tiered)
    assert field in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
    assert free.host is None and bare.host is None and linked.host is link and link.snapshot() == snap


# ------------------------------------------------------------------ the shared tier's URL (issue 38)
BAD_URLS = [
    "redis://[::1", "redis://[::1]:6379x", "redis://127.0.0.1:0", "redis://127.0.0.1:65536", "redis://127.0.0.1:x",
    "redis://127.0.0.1", "redis://:6379", "redis://127.0.0.1:6379/-1", "redis://127.0.0.1:6379/abc",
    "redis://127.0.0.1:6379/0/1", "redis://127.0.0.1:6379/99999999999", "redis://127.0.0.1:6379/١",
    *[f"redis://127.0.0.1:6379?timeout={t}" for t in ("nan", "-1", "inf", "0", "x", "61", "")],
    "redis://127.0.0.1:6379?timeout", "redis://127.0.0.1:6379?timeout=1&timeout=2", "redis://127.0.0.1:6379?db=1",
    "redis://127.0.0.1:6379?ca=ca.pem", "rediss://127.0.0.1:6379?ca=/nonexistent/ca.pem", "redis://user@127.0.0.1:6379",
    "redis://:pa#ss@127.0.0.1:6379", "redis:// 127.0.0.1:6379", "redis://127.0.0.1:6379\n", "http://127.0.0.1:80",
    "", "redis:/x", "redis", "mooncake://127.0.0.1:50051", "mooncake://127.0.0.1:50051?metadata=nope",
    "mooncake://127.0.0.1:50051?metadata=http://127.0.0.1/metadata",
    "mooncake://u:p@127.0.0.1:50051?metadata=http://127.0.0.1:1/metadata",
    "mooncake://127.0.0.1:50051/x?metadata=http://127.0.0.1:1/metadata",
    "mooncake://127.0.0.1:0?metadata=http://127.0.0.1:1/metadata",
    "mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:1/metadata&segment=abc",
    "mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:1/metadata&buffer=-1",
    "mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:1/metadata&protocol=",
    "mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:1/metadata&foo=1",
    "memory://x?capacity=abc", "memory://x?y=1", "memory://u:p@x", "memory://x:5",
]


@pytest.mark.parametrize("url", BAD_URLS)
def test_shared_tier_url_refused_before_any_memory(tiered, url):
    """Every part of a store URL is checked without connecting to anything, before a host tier is
    pinned; the message is one line naming the argument, and never shows a password."""
    from kvatlas.tiers.shared import attach_shared_tier, check_url, open_store
    free = tiered[0]
    for call in (lambda: check_url(url), lambda: open_store(url), lambda: attach_shared_tier(free, "16MiB", url)):
        with pytest.raises(KvatlasError) as exc:
            call()
        text = str(exc.value)
        assert text.startswith("shared_tier") and "\n" not in text and "pa#ss" not in text, text
    assert free.host is None


@pytest.mark.parametrize("bound", [0, -1, NAN, math.inf, 601, "5", None, True])
def test_shared_tier_startup_bound_refused_before_any_memory(tiered, bound):
    from kvatlas.tiers.shared import attach_shared_tier, open_store
    free = tiered[0]
    for call in (lambda: open_store("memory://b", startup_s=bound),
                 lambda: attach_shared_tier(free, "16MiB", "memory://b", startup_s=bound)):
        with pytest.raises(KvatlasError, match="startup_s"):
            call()
    assert free.host is None
