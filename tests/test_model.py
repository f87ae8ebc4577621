import json

import pytest

from kvatlas import ConfigError, LayerKind, load_model, preset_names


def test_presets_listed():
    assert {"deepseek-v4-flash", "deepseek-v4-pro", "deepseek-v4-flash-0731", "deepseek-v4-pro-0813",
            "deepseek-v4.1-flash", "tiny-v4"} <= set(preset_names())


@pytest.mark.parametrize("name,counts,draft", [
    ("deepseek-v4-flash", {LayerKind.SWA: 2, LayerKind.C4: 21, LayerKind.C128: 20}, 1),
    ("deepseek-v4-pro", {LayerKind.SWA: 0, LayerKind.C4: 30, LayerKind.C128: 31}, 1),
    ("deepseek-v4-flash-0731", {LayerKind.SWA: 2, LayerKind.C4: 21, LayerKind.C128: 20}, 4),
    ("deepseek-v4-pro-0813", {LayerKind.SWA: 0, LayerKind.C4: 30, LayerKind.C128: 31}, 4),
    ("deepseek-v4.1-flash", {LayerKind.SWA: 2, LayerKind.R2: 18, LayerKind.R1: 20}, 3),
])
def test_layer_mix(name, counts, draft):
    m = load_model(name)
    for kind, n in counts.items():
        assert m.count(kind) == n
    assert m.num_draft_layers == draft
    assert all(l.kind is LayerKind.SWA for l in m.layers(draft=True) if l.is_draft)
    assert m.head_dim == 512 and m.rope_head_dim == 64 and m.nope_head_dim == 448


def test_v41_sources_and_nesting():
    m = load_model("deepseek-v4.1-flash")
    assert m.family == "v4.1"
    assert [l.index for l in m.layers() if l.stores_compressed] == [2, 8, 14, 20]
    assert m.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)


def test_load_from_file_and_directory(tmp_path):
    src = load_model("deepseek-v4-pro")
    from kvatlas.planning.model import PRESET_DIR
    import os
    raw = open(os.path.join(PRESET_DIR, "deepseek-v4-pro.json")).read()
    d = tmp_path / "DeepSeek-V4-Pro"
    d.mkdir()
    (d / "config.json").write_text(raw)
    by_dir = load_model(d)
    by_file = load_model(d / "config.json")
    assert by_dir.name == by_file.name == "DeepSeek-V4-Pro"
    assert by_dir.compress_ratios == src.compress_ratios


@pytest.mark.parametrize("mutate,field", [
    (lambda c: c.pop("compress_ratios"), "compress_ratios"),
    (lambda c: c.update(compress_ratios=[4, 3] + [0] * 41), "compress_ratios"),
    (lambda c: c.update(num_hidden_layers="forty"), "num_hidden_layers"),
    (lambda c: c.update(compress_ratios=[0] * 10), "compress_ratios"),
    (lambda c: c.update(head_dim=-1), "head_dim"),
    (lambda c: c.update(compress_ratios=[0] * 43 + [4]), "compress_ratios"),
])
def test_malformed_configs_name_the_field(tmp_path, mutate, field):
    from kvatlas.planning.model import PRESET_DIR
    import os
    cfg = json.load(open(os.path.join(PRESET_DIR, "deepseek-v4-flash.json")))
    mutate(cfg)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        load_model(path)
    assert field in str(err.value)


def test_unknown_model_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="neither a preset"):
        load_model("deepseek-v5")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model(bad)
