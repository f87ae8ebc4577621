"""The transformers integration on a CUDA device: the exact layout bit-identical to the model's own
cache there too (generate, chunked prefill, beam search); the fp8 layout through the Triton store
and gather kernels; prefix hits on the device and from pinned host memory bit-identical to the
cold split."""

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytestmark = [pytest.mark.gpu, cuda]

import hf_tiny  # noqa: E402
from hf_tiny import cache_kw  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from kvatlas.integrations.transformers import kvatlas_cache_for  # noqa: E402


def cache_for(m, layout="exact"):
    return kvatlas_cache_for(m, "192MiB", layout=layout, max_running_requests=4, max_model_len=1024,
                             chunked_prefill_tokens=512)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_generate_and_beams_on_cuda_are_bit_identical(dtype):
    m = hf_tiny.model(dtype, seed=1, device="cuda")
    ids = hf_tiny.prompt(400, seed=1).cuda()
    for kw in ({}, {"num_beams": 3, "num_return_sequences": 3}):
        want = m.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True, **kw)
        c = cache_for(m)
        got = m.generate(ids, **cache_kw(m, c), max_new_tokens=6, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, **kw)
        assert torch.equal(got.sequences, want.sequences)
        assert all(torch.equal(a, b) for a, b in zip(got.scores, want.scores))
        c.kv.check_integrity()


def test_chunked_prefill_on_cuda_and_the_fp8_layout_through_triton():
    from kvatlas.datapath import kernels
    m = hf_tiny.model(torch.bfloat16, seed=2, device="cuda")
    ids = hf_tiny.prompt(700, seed=2).cuda()
    own, exact, fp8 = DynamicCache(config=m.config), cache_for(m), cache_for(m, "fp8")
    assert kernels.available() and fp8.layers[1].rings["compressor"].pool.codec.fmt.name == "fp8_ds_mla"
    at, worst = 0, 0.0
    with torch.no_grad():
        for n in (5, 200, 1, 130, 256, 4, 100, 1, 3):
            x = ids[:, at:at + n]
            at += n
            want = m(x, **cache_kw(m, own), use_cache=True).logits
            assert torch.equal(m(x, **cache_kw(m, exact), use_cache=True).logits, want)
            worst = max(worst, float((m(x, **cache_kw(m, fp8), use_cache=True).logits - want).abs().max()))
    print(f"fp8 layout on CUDA: largest logit difference from the own cache {worst:.4f}")
    assert 0 < worst < 1
    fp8.kv.check_integrity()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefix_hits_on_cuda_with_pinned_host_memory(dtype):
    import test_transformers_prefix as prefix
    srv = prefix.hits_on_both_tiers(dtype, device="cuda")
    assert srv.host.snapshot().pinned


def test_fp8_group_reads_are_each_layers_own_on_cuda():
    """The fp8 layout's entries read in groups of layers (one Triton launch a group) give the
    logits that reads layer by layer give, bit for bit, over a generation that crosses C4 and
    C128 windows (passes that write a pool read it layer by layer)."""
    m = hf_tiny.model(torch.bfloat16, seed=3, device="cuda", num_hidden_layers=8, layer_types=hf_tiny.LAYERS * 2)
    ids = hf_tiny.prompt(300, seed=3).cuda()
    out = []
    for most in (64 << 20, 0):
        c = kvatlas_cache_for(m, "192MiB", layout="fp8", max_running_requests=4, max_model_len=1024,
                              chunked_prefill_tokens=512, group_read_bytes=most)
        out.append(m.generate(ids, **cache_kw(m, c), max_new_tokens=40, do_sample=False, output_logits=True,
                              return_dict_in_generate=True))
        c.kv.check_integrity()
    assert torch.equal(out[0].sequences, out[1].sequences)
    assert all(torch.equal(a, b) for a, b in zip(out[0].logits, out[1].logits))
