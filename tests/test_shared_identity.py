"""Which caches share KV through the shared tier: the layout tag names the model by the digest of
its whole config, never by its name (a folder's basename). Two models whose config.json sit in
folders of one name, and a fine-tune beside its base, never read each other's values (a round
trip through a store: written by one, a miss for the other); one config in two folders of other
names is one model; a preset and its config.json are one model; a bookkeeping run's modeled
values live under a tag of their own."""

import json
import os

import numpy as np

from kvatlas import load_model
from kvatlas.alloc import Allocator
from kvatlas.planning.hostplan import plan_host
from kvatlas.planning.model import PRESET_DIR, config_digest
from kvatlas.prefix import PrefixCache, page_keys
from kvatlas.tiers.modeled import ModeledHost
from kvatlas.tiers.shared import layout_of, modeled_shared_link
from kvatlas.tiers.shared.memory_store import MemoryStore

from prefix_session import make_plan
from shared_session import SharedSession, Writer, admit_only, prompts

BASE = json.load(open(os.path.join(PRESET_DIR, "tiny-v4.json")))


def _config(folder, cfg) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return str(folder)


def _tag(model) -> str:
    p = make_plan(0, model)
    return layout_of(plan_host(p, "4MiB", checkpoint_share=0.5), p, "default").tag


def _never_meet(writer_model, reader_model):
    """Written by one model: the other finds nothing (its keys are other keys: absent)."""
    store, seq = MemoryStore(), prompts(7, 1)[0]
    w = Writer(store, model=writer_model)
    w.run(seq)
    assert w.close().puts["page"]["stored"] == 2
    r = SharedSession(store, model=reader_model)
    assert admit_only(r, seq) == 0
    snap = r.close()
    assert snap.hit_tokens == 0 and sum(snap.hits.values()) == 0
    same = SharedSession(store, model=writer_model)    # the control: the writer's own model hits
    assert admit_only(same, seq) == 512
    same.close()


def test_two_models_in_folders_of_one_name_have_two_tags_and_never_read_each_others_values(tmp_path):
    a = _config(tmp_path / "a" / "ft", dict(BASE, hidden_size=384, vocab_size=1024, rope_theta=50000.0))
    b = _config(tmp_path / "b" / "ft", dict(BASE, hidden_size=512, vocab_size=2048, rope_theta=160000.0))
    ma, mb = load_model(a), load_model(b)
    assert ma.name == mb.name == "ft"
    pa, pb = make_plan(0, a), make_plan(0, b)
    assert plan_host(pa, "4MiB").unit_bytes("host_pages") == plan_host(pb, "4MiB").unit_bytes("host_pages")  # one layout
    _never_meet(a, b)       # (before: the reader restored the writer's 512 tokens)
    assert _tag(a) != _tag(b) and ma.config_digest != mb.config_digest


def test_a_fine_tune_beside_its_base_never_meets_it(tmp_path):
    """Its config differs from its base's only where a fine-tune's does: where it came from and
    what saved it (every field that shapes the KV is its base's)."""
    base = _config(tmp_path / "base" / "v4", BASE)
    ft = _config(tmp_path / "tuned" / "v4", dict(BASE, _name_or_path="org/v4-base", transformers_version="5.24.0"))
    _never_meet(ft, base)
    assert _tag(base) != _tag(ft)


def test_one_config_in_two_folders_of_other_names_is_one_model(tmp_path):
    x = _config(tmp_path / "x", dict(BASE, rope_theta=10000.0))
    y = _config(tmp_path / "deploy" / "y-renamed", dict(BASE, rope_theta=10000.0))
    assert load_model(x).name != load_model(y).name and _tag(x) == _tag(y)
    store, seq = MemoryStore(), prompts(8, 1)[0]
    w = Writer(store, model=x)
    w.run(seq)
    w.close()
    r = SharedSession(store, model=y)
    assert admit_only(r, seq) == 512
    r.close()


def test_a_preset_is_the_model_its_config_json_is(tmp_path):
    copy = _config(tmp_path / "some-name", BASE)
    assert load_model("tiny-v4").config_digest == load_model(copy).config_digest == config_digest(BASE)
    assert _tag("tiny-v4") == _tag(copy)
    # key order and spacing are not content; a value is
    assert config_digest(dict(reversed(list(BASE.items())))) == config_digest(BASE)
    assert config_digest(dict(BASE, index_topk=BASE["index_topk"] + 1)) != config_digest(BASE)
    assert load_model("deepseek-v4-flash").config_digest != load_model("deepseek-v4-flash-0731").config_digest


def test_the_namespace_still_separates_deployments():
    p = make_plan(0)
    hp = plan_host(p, "4MiB", checkpoint_share=0.5)
    one, two = layout_of(hp, p, "one"), layout_of(hp, p, "two")
    assert one.tag == two.tag and one.key("page", 1) != two.key("page", 1)


def test_a_bookkeeping_runs_modeled_values_live_under_their_own_tag():
    """A `--backend none` run (payloads modeled at 1/1024) writes first; a real run of the same
    plan and namespace then stores its own values (before, first writer won: the real run's puts
    were `exists`, and a real reader found values of the modeled size) and another cache restores
    them."""
    store, seq = MemoryStore(), prompts(9, 1)[0]
    p = make_plan(0)
    modeled = modeled_shared_link(PrefixCache(Allocator(p)), ModeledHost(p, "4MiB", 0.5), store)
    prefix = modeled.prefix
    keys = page_keys(seq, 256)
    prefix.admit("m", len(seq), 2, page_keys=keys)
    for done in range(0, len(seq) + 2, 256):
        prefix.alloc.extend("m", min(256, len(seq) + 2 - done))
    prefix.finish("m", token_ids=np.concatenate((seq, [7, 8])))
    modeled.shared.flush(5.0)
    assert modeled.shared_snapshot().puts["page"]["stored"] == 2
    real = layout_of(plan_host(p, "4MiB", checkpoint_share=0.5), p, "default")
    assert modeled.shared.layout.tag != real.tag and modeled.shared.layout.payload_bytes == real.payload_bytes
    w = Writer(store)
    w.run(seq)
    puts = w.close().puts
    assert (puts["page"]["stored"], puts["page"]["exists"], puts["checkpoint"]["stored"]) == (2, 0, 1)
    r = SharedSession(store)
    assert admit_only(r, seq) == 512
    r.close()
    assert p.model.config_digest == config_digest(BASE)
