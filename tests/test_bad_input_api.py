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


@pytest.mark.parametrize("options,field", PLAN, ids=[repr(o)[:40] for o, _ in PLAN])
def test_plan_options_refused(options, field):
    opts = {"memory_bytes": "64MiB", "max_running_requests": 4, **options}
    memory = opts.pop("memory_bytes")
    with pytest.raises(KvatlasError) as exc:
        kvatlas.plan("tiny-v4", memory, **opts)
    assert field in str(exc.value) and "\n" not in str(exc.value)


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
