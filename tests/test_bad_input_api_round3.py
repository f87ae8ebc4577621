"""Bad input through the Python API, round three (issue 38): the modules added last round —
advice, observing, the shared tier's API arguments, driving, the transformers integration. Every
case raises a KvatlasError (a ValueError) whose one-line message names the argument, never a raw
TypeError/AttributeError/IndexError from inside; the cache it was tried on is left exactly as it
was (tests/test_bad_input_api.py's fingerprint) and still passes its integrity check."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvatlas  # noqa: E402
from kvatlas import KvatlasError  # noqa: E402
from test_bad_input_api import fingerprint  # noqa: E402

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A cache with a prefix cache and running requests, a small workload, and a scratch dir."""
    from kvatlas.driving.workload import synthetic
    p = kvatlas.plan("tiny-v4", "64MiB", max_running_requests=4, max_model_len=2048, prefix_checkpoints=8)
    c = kvatlas.allocate(p)
    c.admit("a", 300, 40)
    c.extend("a", 300)
    c.admit("b", 100, 10)
    reqs = synthetic(rate_per_s=10, duration_s=0.3, prompt="uniform:16:300", output="uniform:2:10", seed=1)
    return {"plan": p, "cache": c, "reqs": reqs, "tmp": tmp_path_factory.mktemp("api3")}


def _sim(w, **kw):
    from kvatlas.driving.sim import Simulator
    return Simulator(w["cache"], w["reqs"], **kw)


def _calls():
    from kvatlas.advice import Pace, profile, tune
    from kvatlas.driving.latency import write_requests_csv
    from kvatlas.driving.limits import LimitLog, verdict
    from kvatlas.driving.sim import Simulator
    from kvatlas.driving.timemodel import TimeModel
    from kvatlas.observing import shipped
    out = []
    # driving: the time model, the simulator, its drivers
    out += [(f"TimeModel({k}={v!r})", lambda w, k=k, v=v: TimeModel(**{k: v}), k) for k, v in (
        ("pass_s", "x"), ("pass_s", None), ("pass_s", [1]), ("pass_s", True), ("pass_s", 0), ("pass_s", NAN),
        ("prefill_s_per_token", "1e-6"), ("prefill_s_per_token", -1e-6), ("decode_s_per_token", INF),
        ("decode_s_per_token", "0"))]
    out += [("Simulator('x', reqs)", lambda w: Simulator("x", w["reqs"]), "cache"),
            ("Simulator(None, reqs)", lambda w: Simulator(None, w["reqs"]), "cache"),
            ("Simulator(plan, reqs)", lambda w: Simulator(w["plan"], w["reqs"]), "cache"),
            ("Simulator(c, None)", lambda w: Simulator(w["cache"], None), "requests"),
            ("Simulator(c, 'abc')", lambda w: Simulator(w["cache"], "abc"), "requests"),
            ("Simulator(c, 5)", lambda w: Simulator(w["cache"], 5), "requests"),
            ("Simulator(c, [1, 2])", lambda w: Simulator(w["cache"], [1, 2]), "requests"),
            ("Simulator(c, [None])", lambda w: Simulator(w["cache"], [None]), "requests")]
    out += [(f"Simulator({k}={v!r})", lambda w, k=k, v=v: _sim(w, **{k: v}), k) for k, v in (
        ("seed", -1), ("seed", "x"), ("seed", 1.5), ("seed", 2**64), ("seed", None), ("accept_rate", 2),
        ("accept_rate", -0.1), ("accept_rate", NAN), ("accept_rate", "0.5"), ("time_model", "x"),
        ("time_model", 0.02), ("sample_s", -1), ("sample_s", NAN), ("sample_s", "1"), ("record", "yes"),
        ("record", 1), ("check_integrity", 1), ("check_integrity", None), ("host", "x"), ("host", 5),
        ("writer", "x"), ("writer", object()), ("step_s", NAN), ("step_s", 0), ("step_s", "0.02"),
        ("integrity_share", 0), ("integrity_share", -1.0), ("integrity_share", NAN), ("integrity_share", "1"))]
    out += [(f"run_offline(max_steps={v!r})", lambda w, v=v: _sim(w).run_offline(max_steps=v), "max_steps")
            for v in ("10", 0, -1, 1.5, True, NAN)]
    out += [(f"run_offline(on_step={v!r})", lambda w, v=v: _sim(w).run_offline(on_step=v), "on_step")
            for v in (5, "print")]
    out += [(f"step({v!r})", lambda w, v=v: _sim(w).step(v), "now_s") for v in ("x", NAN, -1.0, INF, None)]
    # the requests CSV
    out += [("write_requests_csv(None, [])", lambda w: write_requests_csv(None, []), "path"),
            ("write_requests_csv('', [])", lambda w: write_requests_csv("", []), "path"),
            ("write_requests_csv(5, [])", lambda w: write_requests_csv(5, []), "path"),
            ("write_requests_csv('/proc/x.csv', [])", lambda w: write_requests_csv("/proc/x.csv", []), "path"),
            ("write_requests_csv(a dir, [])", lambda w: write_requests_csv(str(w["tmp"]), []), "path"),
            ("write_requests_csv(under a file)", lambda w: write_requests_csv(__file__ + "/x.csv", []), "path"),
            ("write_requests_csv(x, 5)", lambda w: write_requests_csv(str(w["tmp"] / "x.csv"), 5), "timings"),
            ("write_requests_csv(x, 'ab')", lambda w: write_requests_csv(str(w["tmp"] / "x.csv"), "ab"), "timings"),
            ("write_requests_csv(x, [1])", lambda w: write_requests_csv(str(w["tmp"] / "x.csv"), [1]), "timings"),
            ("write_requests_csv(x, None)", lambda w: write_requests_csv(str(w["tmp"] / "x.csv"), None), "timings")]
    # the binding-limit verdict
    out += [("verdict(None, plan)", lambda w: verdict(None, w["plan"]), "log"),
            ("verdict({}, plan)", lambda w: verdict({}, w["plan"]), "log"),
            ("verdict(log, None)", lambda w: verdict(LimitLog(), None), "plan"),
            ("verdict(log, 'tiny-v4')", lambda w: verdict(LimitLog(), "tiny-v4"), "plan"),
            ("verdict(log, cache)", lambda w: verdict(LimitLog(), w["cache"]), "plan")]
    # audit
    out += [(f"audit({k}={v!r})", lambda w, k=k, v=v: kvatlas.audit(w["cache"], **{k: v}), k) for k, v in (
        ("max_depth", "deep"), ("max_depth", 1.5), ("max_depth", None), ("max_depth", -1), ("max_depth", True),
        ("max_objects", "many"), ("max_objects", 0), ("max_objects", 2.0), ("root", 5), ("root", None))]
    # advice: the profile, the pace, tune
    out += [(f"profile({v!r:.20})", lambda w, v=v: profile(v), "requests") for v in
            (None, [1, 2], "abc", 5, {"a": 1}, [None], [(0.0, 100, 10)])]
    out += [("profile([])", lambda w: profile([]), "workload")]
    out += [(f"profile(chunk={v!r})", lambda w, v=v: profile(w["reqs"], chunk=v), "chunk") for v in
            (0, -8192, 1.5, "8192", None, True, 2**40)]
    out += [(f"profile(pace={v!r})", lambda w, v=v: profile(w["reqs"], v), "pace") for v in ("x", None, 0.02)]
    out += [(f"Pace({k}={v!r})", lambda w, k=k, v=v: Pace(**{k: v}), k) for k, v in (
        ("pass_s", NAN), ("pass_s", "x"), ("pass_s", 0), ("pass_s", -1), ("pass_s", INF), ("pass_s", None),
        ("prefill_s_per_token", "x"), ("prefill_s_per_token", -1e-6), ("decode_s_per_token", NAN),
        ("decode_s_per_token", True))]
    prof = lambda w: profile(w["reqs"])   # noqa: E731
    out += [("tune(m, None)", lambda w: tune("tiny-v4", None), "prof"),
            ("tune(m, reqs)", lambda w: tune("tiny-v4", w["reqs"]), "prof"),
            ("tune(m, {})", lambda w: tune("tiny-v4", {}), "prof"),
            ("tune(None, prof)", lambda w: tune(None, prof(w)), "model"),
            ("tune(5, prof)", lambda w: tune(5, prof(w)), "model"),
            ("tune(pace='x')", lambda w: tune("tiny-v4", prof(w), pace="x", memory_bytes=2**30), "pace"),
            ("tune(engines=())", lambda w: tune("tiny-v4", prof(w), engines=(), memory_bytes=2**30), "engines"),
            ("tune(engines='vllm')", lambda w: tune("tiny-v4", prof(w), engines="vllm", memory_bytes=2**30), "engines"),
            ("tune(engines=None)", lambda w: tune("tiny-v4", prof(w), engines=None, memory_bytes=2**30), "engines"),
            ("tune(engines=[5])", lambda w: tune("tiny-v4", prof(w), engines=[5], memory_bytes=2**30), "engines"),
            ("tune(engines=['trt'])", lambda w: tune("tiny-v4", prof(w), engines=["trt"], memory_bytes=2**30), "engines"),
            ("tune(max_model_len=100)", lambda w: tune("tiny-v4", prof(w), memory_bytes=2**30, max_model_len=100),
             "workload"),
            ("tune(max_model_len=0)", lambda w: tune("tiny-v4", prof(w), memory_bytes=2**30, max_model_len=0),
             "max_model_len"),
            ("tune(memory_bytes=4MiB)", lambda w: tune("tiny-v4", prof(w), memory_bytes=4 << 20), "memory_bytes")]
    # the shipped files
    out += [(f"shipped.read({v!r})", lambda w, v=v: shipped.read(v), "name") for v in (None, "", " ", 5, "nope")]
    out += [(f"shipped.path({v!r})", lambda w, v=v: shipped.path(v), "name") for v in (None, "", ["rules"])]
    out += [(f"shipped.write_all({v!r})", lambda w, v=v: shipped.write_all(v), "folder") for v in
            ("/proc/x", "/proc/x/y", None, "", 5, __file__, __file__ + "/sub")]
    out += [(f"shipped.validator({v!r:.30})", lambda w, v=v: shipped.validator(v), "schema") for v in
            (None, 5, "kvatlas.plan", {}, {"schema": 5, "schema_version": 1}, {"schema": "kvatlas.nope", "schema_version": 1})]
    out += [(f"shipped.schema_path(v={v!r})", lambda w, v=v: shipped.schema_path("kvatlas.plan", v), "schema_version")
            for v in ("x", 1.0, True, 2)]
    out += [(f"shipped.bundled({v!r})", lambda w, v=v: shipped.bundled(v), "schema") for v in (None, "kvatlas.nope", "")]
    # the inverse takes no budget
    out += [(f"budget_for({k}=...)", lambda w, k=k, v=v: kvatlas.budget_for("tiny-v4", 4, 2048, **{k: v}), k)
            for k, v in (("memory_bytes", 2**30), ("memory_bytes", "1GiB"), ("mem_fraction", 0.5),
                         ("weights_bytes", 2**30))]
    return out


CALLS = _calls()


@pytest.mark.parametrize("call,field", [c[1:] for c in CALLS], ids=[c[0] for c in CALLS])
def test_public_call_refused_naming_the_argument(world, call, field):
    cache = world["cache"]
    before, snap = fingerprint(cache), cache.ledger.snapshot()
    with pytest.raises(KvatlasError) as exc:
        call(world)
    msg = str(exc.value)
    assert field in msg and "\n" not in msg, msg
    assert fingerprint(cache) == before and cache.ledger.snapshot() == snap
    assert cache.host is None
    cache.check_integrity()


# ------------------------------------------------------------------ the shared tier's API arguments
def _shared_calls():
    from kvatlas.tiers.modeled import ModeledHost
    from kvatlas.tiers.shared import attach_shared_tier, modeled_shared_link

    def attach(*a, **kw):
        return lambda w: attach_shared_tier(w["cache"], "4MiB", *a, **kw)

    def modeled(**kw):
        return lambda w: modeled_shared_link(w["cache"].prefix, ModeledHost(w["plan"], 4 << 20), "memory://m3", **kw)
    out = [(f"store={v!r:.20}", attach(v), "store") for v in (None, 123, object(), 1.5, b"redis://x", ["memory://x"])]
    out += [("bogus=1", attach("memory://a1", bogus=1), "bogus"), ("pinned=1", attach("memory://a2", pinned=1), "pinned")]
    out += [(f"namespace={v!r}", attach("memory://a3", namespace=v), "namespace")
            for v in (None, "", "a/b", " ", "a b", 5, "x" * 200, "../up", "ns\n")]
    out += [(f"writer={v!r}", attach("memory://a4", writer=v), "writer") for v in (-1, "me", 1.5, None, True, 2**64)]
    out += [(f"policy={v!r}", attach("memory://a5", policy=v), "policy") for v in ("always", None, "")]
    out += [(f"deadline_s={v!r}", attach("memory://a6", deadline_s=v), "deadline_s") for v in (0, -1, NAN, "1", INF)]
    out += [("cache='x'", lambda w: attach_shared_tier("x", "4MiB", "memory://a7"), "cache"),
            ("cache=None", lambda w: attach_shared_tier(None, "4MiB", "memory://a8"), "cache"),
            ("cache=plan", lambda w: attach_shared_tier(w["plan"], "4MiB", "memory://a9"), "cache"),
            ("host_memory_bytes=None", lambda w: attach_shared_tier(w["cache"], None, "memory://b1"), "host_memory_bytes"),
            ("host_memory_bytes='x'", lambda w: attach_shared_tier(w["cache"], "x", "memory://b2"), "host_memory_bytes")]
    out += [(f"modeled {k}={v!r}", modeled(**{k: v}), k) for k, v in (
        ("namespace", "a/b"), ("namespace", ""), ("writer", -1), ("writer", "me"), ("policy", "x"), ("deadline_s", 0))]
    return out


SHARED = _shared_calls()


@pytest.mark.parametrize("call,field", [c[1:] for c in SHARED], ids=[c[0] for c in SHARED])
def test_shared_tier_arguments_refused_before_anything_is_pinned(world, call, field):
    cache = world["cache"]
    before = fingerprint(cache)
    with pytest.raises(KvatlasError) as exc:
        call(world)
    assert field in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
    assert cache.host is None and fingerprint(cache) == before
    cache.check_integrity()


def test_a_second_tier_over_a_host_tier_is_refused():
    from kvatlas.tiers import attach_host_tier
    from kvatlas.tiers.shared import attach_shared_tier
    c = kvatlas.allocate(kvatlas.plan("tiny-v4", "64MiB", max_running_requests=4, prefix_checkpoints=8))
    link = attach_host_tier(c, "4MiB")
    for attach in (lambda: attach_shared_tier(c, "4MiB", "memory://second"), lambda: attach_host_tier(c, "4MiB")):
        with pytest.raises(KvatlasError, match="a host tier is attached already"):
            attach()
        assert c.host is link
    c.close()
    shared = kvatlas.allocate(kvatlas.plan("tiny-v4", "64MiB", max_running_requests=4, prefix_checkpoints=8))
    first = attach_shared_tier(shared, "4MiB", "memory://first")
    with pytest.raises(KvatlasError, match="a host tier is attached already"):
        attach_shared_tier(shared, "4MiB", "memory://first")
    assert shared.host is first
    shared.close()


# ------------------------------------------------------------------ the transformers integration
@pytest.fixture(scope="module")
def hf():
    hf_tiny = pytest.importorskip("hf_tiny")
    from kvatlas.integrations.transformers import kvatlas_cache_for
    from kvatlas.integrations.transformers.serve import Server
    model = hf_tiny.model()
    cache = kvatlas_cache_for(model, "64MiB", max_running_requests=4, max_model_len=1024, chunked_prefill_tokens=256)
    cache.kv.admit("r0", 8, 4)
    cache.kv.admit("r1", 8, 4)
    server_cache = kvatlas_cache_for(model, "64MiB", max_running_requests=4, max_model_len=1024,
                                     chunked_prefill_tokens=256)
    return {"model": model, "cache": cache, "server": Server(model, server_cache), "vocab": hf_tiny.VOCAB}


def _hf_calls():
    from kvatlas.integrations.transformers import KvatlasCache, kvatlas_cache_for, plan_for
    from kvatlas.integrations.transformers.serve import Server
    out = [(f"kvatlas_cache_for({v!r:.20})", lambda h, v=v: kvatlas_cache_for(v, "64MiB"), "model")
           for v in (None, "tiny", 5, object())]
    out += [(f"plan_for({v!r:.20})", lambda h, v=v: plan_for(v, "64MiB"), "model") for v in (None, "x")]
    out += [("kvatlas_cache_for(layout='x')", lambda h: kvatlas_cache_for(h["model"], "64MiB", layout="x"), "layout"),
            ("kvatlas_cache_for(memory=None)", lambda h: kvatlas_cache_for(h["model"], None), "memory"),
            ("kvatlas_cache_for(validate='y')", lambda h: kvatlas_cache_for(h["model"], "64MiB", max_running_requests=4,
                                                                            max_model_len=1024, validate="y"), "validate")]
    out += [(f"KvatlasCache({v!r:.20}, model)", lambda h, v=v: KvatlasCache(v, h["model"]), "kv")
            for v in ("x", None, 5)]
    out += [("KvatlasCache(kv, None)", lambda h: KvatlasCache(h["cache"].kv, None), "model"),
            ("KvatlasCache(kv, 'm')", lambda h: KvatlasCache(h["cache"].kv, "m"), "model"),
            ("KvatlasCache(group_read_bytes=-1)", lambda h: KvatlasCache(h["cache"].kv, h["model"], group_read_bytes=-1),
             "group_read_bytes")]
    out += [(f"bind({v!r})", lambda h, v=v: h["cache"].bind(v), f) for v, f in (
        (None, "request_ids"), (5, "request_ids"), ("r0", "request_ids"), (["nope"], "request_id"),
        ([None], "request_id"), ([[1]], "request_id"), (["r0", "r0"], "request_ids"))]
    out += [(f"reorder_cache({v!r})", lambda h, v=v: h["cache"].bind(["r0", "r1"]).reorder_cache(v), "beam_idx")
            for v in (torch.tensor([0]), torch.tensor([0, 1, 2]), torch.tensor([0, 2]), torch.tensor([-1, 0]),
                      [0, 5], [0.5, 1], ["0", "1"], [True, False])]
    out += [(f"submit({v!r:.24})", lambda h, v=v: h["server"].submit("q", v, 4), "prompt_ids") for v in (
        "hello", b"abc", None, [-1, 2], [1, 10**6], [1, 256], [1.5, 2.0], [[1, 2], [3]], ["1", "2"], [True, False],
        torch.tensor([1, 300]), np.array([1, -5]), [], {"a": 1})]
    out += [(f"submit(id={v!r})", lambda h, v=v: h["server"].submit(v, [1, 2], 4), "request_id") for v in
            (None, [1], NAN)]
    out += [(f"submit(max_new_tokens={v!r})", lambda h, v=v: h["server"].submit("q", [1, 2], v), "max_new_tokens")
            for v in (0, -1, "4", 1.5)]
    out += [("Server(None, cache)", lambda h: Server(None, h["cache"]), "model"),
            ("Server(model, 'x')", lambda h: Server(h["model"], "x"), "cache"),
            ("Server(model, kv)", lambda h: Server(h["model"], h["cache"].kv), "cache"),
            ("Server(host='x')", lambda h: Server(h["model"], h["cache"], host="x"), "host"),
            ("Server(keep_logits='y')", lambda h: Server(h["model"], h["cache"], keep_logits="y"), "keep_logits"),
            ("Server(eos_token_id=-1)", lambda h: Server(h["model"], h["cache"], eos_token_id=-1), "eos_token_id"),
            ("Server(eos_token_id=256)", lambda h: Server(h["model"], h["cache"], eos_token_id=256), "eos_token_id"),
            ("Server(chunk_tokens=0)", lambda h: Server(h["model"], h["cache"], chunk_tokens=0), "chunk_tokens")]
    return out


HF = _hf_calls() if __import__("importlib").util.find_spec("transformers") else []


@pytest.mark.parametrize("call,field", [c[1:] for c in HF], ids=[c[0] for c in HF])
def test_transformers_call_refused_naming_the_argument(hf, call, field):
    kv = hf["cache"].kv
    before, waiting = fingerprint(kv), len(hf["server"].waiting)
    bound = hf["cache"].request_ids
    with pytest.raises(KvatlasError) as exc:
        call(hf)
    assert field in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
    assert fingerprint(kv) == before and len(hf["server"].waiting) == waiting
    assert hf["cache"].request_ids in (bound, ("r0", "r1"))   # a refused bind leaves the rows bound before
    kv.check_integrity()
