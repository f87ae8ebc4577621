"""Weights per rank from the config (planning.weights): the parameter count equals transformers'
own DeepSeek-V4 model built on the meta device from the same config.json, the bytes equal the
released checkpoint's, and the per-rank split behind `--weights auto`."""

import json
import os

import pytest

import kvatlas
from kvatlas.errors import ConfigError
from kvatlas.planning import weights
from kvatlas.planning.model import PRESET_DIR
from kvatlas.planning.options import GPU_MEMORY_BYTES
from kvatlas.planning.planner import rank_layers

# the released V4-Flash checkpoint's model.safetensors.index.json: metadata.total_size
FLASH_CHECKPOINT_BYTES = 159_609_485_896

# bytes one rank holds at TP 1 / 4 / 8 (docs/weights.md states them with the dtype rule)
PER_RANK = {
    "deepseek-v4-flash": {1: 159_609_485_896, 4: 40_924_052_296, 8: 21_143_146_696},
    "deepseek-v4-pro": {1: 864_704_792_696, 4: 218_941_650_200, 8: 111_314_459_784},
}


@pytest.mark.parametrize("name", ["tiny-v4", "deepseek-v4-flash", "deepseek-v4-pro"])
def test_parameter_count_equals_transformers_model_on_meta(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    with open(os.path.join(PRESET_DIR, f"{name}.json")) as f:
        cfg = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    from transformers.models.deepseek_v4 import DeepseekV4ForCausalLM
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    theirs = sum(p.numel() for p in model.parameters())
    assert weights.parameter_count(kvatlas.load_model(name)) == theirs
    # and part by part: the experts and the attention are where a wrong shape would hide
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    ours = sum(t.count * t.shape[0] * t.shape[1] for t in weights.tensors(kvatlas.load_model(name))
               if ".ffn.experts." in t.name and t.param)
    assert ours == experts


def test_presets_keep_the_released_quantization_config():
    for name in ("deepseek-v4-flash", "deepseek-v4-pro", "deepseek-v4-flash-0731", "deepseek-v4-pro-0813"):
        with open(os.path.join(PRESET_DIR, f"{name}.json")) as f:
            cfg = json.load(f)
        q = cfg["quantization_config"]
        assert (q["quant_method"], q["fmt"], q["scale_fmt"], q["weight_block_size"]) == ("fp8", "e4m3", "ue8m0", [128, 128])
        assert cfg["expert_dtype"] == "fp4"


def test_flash_bytes_equal_the_released_checkpoint():
    assert weights.checkpoint_bytes(kvatlas.load_model("deepseek-v4-flash")) == FLASH_CHECKPOINT_BYTES


@pytest.mark.parametrize("name", sorted(PER_RANK))
def test_bytes_per_rank_for_tp_1_4_8(name):
    model = kvatlas.load_model(name)
    for tp, expected in PER_RANK[name].items():
        w = weights.weights_per_rank(model, tp)
        assert w.bytes == expected == sum(w.by_part.values())
    # TP divides what it splits and replicates the rest: tp ranks hold at least the whole once
    for tp in (4, 8):
        assert tp * PER_RANK[name][tp] >= PER_RANK[name][1] > (tp - 1) * PER_RANK[name][tp]


def test_fp8_and_fp4_byte_rules():
    fp8 = weights.Tensor(name="w", shape=(300, 200), stored="fp8", split="out", count=1, where="layer")
    assert weights.tensor_bytes(fp8, (300, 200)) == 300 * 200 + 3 * 2   # one ue8m0 byte per 128x128 block
    fp4 = weights.Tensor(name="e", shape=(2048, 4096), stored="fp4", split="expert", count=1, where="layer")
    assert weights.tensor_bytes(fp4, (2048, 4096)) == 2048 * 2048 + 2048 * 128   # two per byte, a scale per 32


def test_pipeline_stages_add_up_to_the_whole():
    model = kvatlas.load_model("deepseek-v4-flash")
    for pp in (2, 3, 4):
        total = 0
        for r in range(pp):
            opts = kvatlas.ServeOptions(pp=pp, pp_rank=r).resolve(model)
            total += weights.weights_per_rank(model, 1, pp, r, rank_layers(model, opts)).bytes
        assert total == FLASH_CHECKPOINT_BYTES


def test_auto_weights_leave_the_budget_they_say():
    p = kvatlas.plan("deepseek-v4-flash", weights_bytes="auto", tp=4)
    share = int(GPU_MEMORY_BYTES["h200"] * 0.9)
    assert p.options.weights_from_config and p.options.weights_bytes == PER_RANK["deepseek-v4-flash"][4]
    assert p.budget_bytes == share - PER_RANK["deepseek-v4-flash"][4]
    with pytest.raises(ConfigError, match="weights_bytes: given beside memory_bytes"):   # the budget itself
        kvatlas.plan("deepseek-v4-flash", "16GiB", weights_bytes="auto")


def test_auto_weights_refuse_what_does_not_fit_and_name_the_tp():
    with pytest.raises(ConfigError) as exc:
        kvatlas.plan("deepseek-v4-pro", weights_bytes="auto")
    assert "use tp=8 or more" in str(exc.value) and "--" not in str(exc.value)   # Python names, not flags
    with pytest.raises(ConfigError) as exc:
        kvatlas.plan("deepseek-v4.1-flash", weights_bytes="auto")
    assert "give weights_bytes=BYTES" in str(exc.value)
