"""Compression invariant: any split into prefill chunks, decode steps and draft/rollback rounds
gives the entries of compressing the whole sequence at once; online C128 == ring C128."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas import formats
from kvatlas.datapath import DataPathError, RingOverrunError
from kvatlas.datapath.compressor import (CompressorSpec, clear_rows, compress_batch, compress_sequence,
                                         rollback)
from kvatlas.datapath.online import online_compress_batch

D = 8
SLOW = [HealthCheck.too_slow, HealthCheck.large_base_example, HealthCheck.data_too_large]
CONFIGS = {  # name: (ratio, ring rows, sequence length cap)
    "c4": (4, 8, 120), "c4_spec": (4, 16, 120), "c128": (128, 128, 600), "c128_spec": (128, 256, 600),
}


def write_pad(ratio, ring):
    window = 2 * ratio if ratio == 4 else ratio
    return formats.StateRing(name="t", width=0, rows=ring, window=window).write_pad


class Request:
    def __init__(self, slot, length, ratio, gen):
        coff = 2 if ratio == 4 else 1
        self.slot, self.length, self.done = slot, length, 0
        self.kv = torch.randn(length, coff * D, generator=gen)
        self.score = torch.randn(length, coff * D, generator=gen) * 2


def run_scenario(data, ratio, ring, cap, state_dtype=torch.float32, n_req=None):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    coff = 2 if ratio == 4 else 1
    ape = torch.randn(ratio, coff * D, generator=gen) if data.draw(st.booleans(), label="ape") else None
    n_req = n_req or data.draw(st.integers(1, 3), label="requests")
    reqs = [Request(s, data.draw(st.integers(1, cap), label="length"), ratio, gen) for s in range(1, n_req + 1)]
    state = torch.full((n_req + 2, 2, ring, 2 * coff * D), 7.0, dtype=state_dtype)  # stale garbage
    clear_rows(state, torch.tensor([r.slot for r in reqs]), layers=1)
    pad = write_pad(ratio, ring)
    got = {}
    while any(r.done < r.length for r in reqs):
        batch, drafts = [], []
        for r in reqs:
            left = r.length - r.done
            if left == 0 or data.draw(st.booleans(), label="skip this step"):
                continue
            kind = data.draw(st.sampled_from(["prefill", "decode", "draft"] if pad else ["prefill", "decode"]))
            n = {"prefill": data.draw(st.integers(1, min(left, 3 * ratio))), "decode": 1}.get(kind)
            if kind == "draft":
                d = data.draw(st.integers(1, pad), label="drafts")
                a = data.draw(st.integers(1, min(d, left)), label="accepted")
                kv = torch.cat((r.kv[r.done:r.done + a], torch.randn(d - a, coff * D, generator=gen) * 5))
                sc = torch.cat((r.score[r.done:r.done + a], torch.randn(d - a, coff * D, generator=gen) * 5))
                batch.append((r, r.done, kv, sc))
                drafts.append((r, r.done + a, r.done + d))
                r.done += a
            else:
                batch.append((r, r.done, r.kv[r.done:r.done + n], r.score[r.done:r.done + n]))
                r.done += n
        if not batch:
            continue
        slots = torch.cat([torch.full((kv.shape[0],), r.slot) for r, _, kv, _ in batch])
        pos = torch.cat([torch.arange(p, p + kv.shape[0]) for _, p, kv, _ in batch])
        blocks = compress_batch(state, 1, slots, pos, torch.cat([b[2] for b in batch]),
                                torch.cat([b[3] for b in batch]), ratio=ratio, ape=ape)
        for s, i, e in zip(blocks.req_slots.tolist(), blocks.block_ids.tolist(), blocks.entries):
            got[(s, i)] = e   # a later write replaces a speculative entry, as in the pool
        for r, committed, written in drafts:
            rollback(state, 1, r.slot, committed, written, ratio=ratio)
    assert bool((state[0] == 7.0).all()) and bool((state[-1] == 7.0).all())  # other slots untouched
    assert bool((state[1:-1, 0] == 7.0).all())                                # other layer untouched
    for r in reqs:
        want = compress_sequence(r.kv, r.score, ratio=ratio, ape=ape, state_dtype=state_dtype)
        if len(want):
            have = torch.stack([got[(r.slot, i)] for i in range(len(want))])
            torch.testing.assert_close(have, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("config", sorted(CONFIGS))
@settings(max_examples=30, deadline=None, suppress_health_check=SLOW)
@given(data=st.data())
def test_incremental_equals_whole_sequence(config, data):
    run_scenario(data, *CONFIGS[config])


@settings(max_examples=10, deadline=None, suppress_health_check=SLOW)
@given(data=st.data())
def test_incremental_equals_whole_sequence_bf16_state(data):
    run_scenario(data, 4, 16, 80, state_dtype=torch.bfloat16)


def test_c4_block_semantics_by_hand():
    """Block 1 of C4 = softmax over tokens 0..3 first halves and 4..7 second halves."""
    kv = torch.arange(8 * 2 * D, dtype=torch.float32).reshape(8, 2 * D)
    score = torch.zeros(8, 2 * D)
    score[:4, :D] = -1e9   # previous block's first halves weigh ~0 -> mean of current second halves
    out = compress_sequence(kv, score, ratio=4)
    torch.testing.assert_close(out[1], kv[4:8, D:].mean(0))
    torch.testing.assert_close(out[0], kv[0:4, D:].mean(0))   # block 0: its own 4 tokens only
    score = torch.zeros(8, 2 * D)
    out = compress_sequence(kv, score, ratio=4)
    torch.testing.assert_close(out[1], torch.cat((kv[0:4, :D], kv[4:8, D:])).mean(0))


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_online_c128_equals_ring(data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    length = data.draw(st.integers(1, 700))
    kv, score = torch.randn(length, D, generator=gen), torch.randn(length, D, generator=gen) * 4
    ape = torch.randn(128, D, generator=gen)
    ring = torch.zeros(3, 1, 128, 2 * D)
    clear_rows(ring, torch.tensor([2]))
    online = torch.full((3, 1, 1, 3 * D), 7.0)    # rows need no clearing: block starts overwrite
    got_ring, got_online, p = {}, {}, 0
    while p < length:
        n = data.draw(st.sampled_from([1, 1, 7, 64, 127, 128, 300]))
        n = min(n, length - p)
        args = (torch.full((n,), 2), torch.arange(p, p + n), kv[p:p + n], score[p:p + n])
        for fn, st_, got in ((compress_batch, ring, got_ring), (online_compress_batch, online, got_online)):
            b = fn(st_, 0, *args, ratio=128, ape=ape)
            got.update({i: e for i, e in zip(b.block_ids.tolist(), b.entries)})
        p += n
    assert got_ring.keys() == got_online.keys() == set(range(length // 128))
    for i in got_ring:
        torch.testing.assert_close(got_online[i], got_ring[i], rtol=1e-5, atol=1e-5)
    assert bool((online[:2] == 7.0).all())


def test_rollback_detects_overrun_beyond_write_pad():
    state = torch.zeros(2, 1, 16, 4 * D)
    clear_rows(state, torch.tensor([1]))
    pad = write_pad(4, 16)
    assert pad == 10
    # worst case: commit one token, the next block's window reaches 6 positions back
    rollback(state, 0, 1, committed=23, written=22 + pad, ratio=4)
    with pytest.raises(RingOverrunError):
        rollback(state, 0, 1, committed=23, written=22 + pad + 1, ratio=4)
    rollback(state, 0, 1, committed=5, written=5, ratio=4)   # nothing drafted: no-op
    assert bool((state[1, 0, :, 2 * D:] == float("-inf")).all())


def test_batch_validation():
    state = torch.zeros(3, 1, 8, 4 * D)
    kv = torch.zeros(3, 2 * D)
    with pytest.raises(DataPathError):
        compress_batch(state, 0, torch.tensor([1, 1, 1]), torch.tensor([0, 1, 3]), kv, kv, ratio=4)
    with pytest.raises(DataPathError):
        compress_batch(state, 0, torch.tensor([1, 2, 1]), torch.tensor([0, 0, 1]), kv, kv, ratio=4)
    with pytest.raises(DataPathError):
        compress_batch(state, 0, torch.tensor([1, 1, 1]), torch.tensor([0, 1, 2]), kv[:, :D], kv, ratio=4)
    with pytest.raises(DataPathError):
        compress_batch(torch.zeros(3, 1, 4, 4 * D), 0, torch.tensor([1]), torch.tensor([0]), kv[:1], kv[:1], ratio=4)
    with pytest.raises(DataPathError):
        online_compress_batch(torch.zeros(3, 1, 1, 3 * D, dtype=torch.bfloat16), 0, torch.tensor([1]),
                              torch.tensor([0]), kv[:1, :D], kv[:1, :D])


def test_spec_from_formats_rings():
    for ring, ratio, d in ((formats.c4_attention_ring(512, True), 4, 512),
                           (formats.c4_indexer_ring(128, False), 4, 128),
                           (formats.c128_ring(512, True, False), 128, 512)):
        state = torch.empty(1, 1, ring.rows, ring.width)
        spec = CompressorSpec.for_state(state, ratio)
        assert spec.head_dim == d and spec.window == ring.window


def test_compressed_entries_into_pools():
    """C4 attention entries into an fp8_ds_mla pool and indexer keys into an fp8 indexer pool,
    at the slots the block table gives (page boundaries of 256 tokens = 64 C4 entries)."""
    from kvatlas.datapath import CODECS, PageGeometry, compressed_slots, gather, store
    torch.manual_seed(5)
    table = torch.tensor([[0, 0], [3, 1], [2, 4]], dtype=torch.int32)   # request slot -> full pages
    pools = {}
    for name, d in (("fp8_ds_mla", 512), ("indexer_fp8", 128)):
        state = torch.empty(3, 1, 8, 4 * d)
        clear_rows(state, torch.tensor([1, 2]))
        t = 300
        req = torch.cat((torch.full((t,), 1), torch.full((t,), 2)))
        pos = torch.cat((torch.arange(t), torch.arange(t)))
        kv, sc = torch.randn(2 * t, 2 * d), torch.randn(2 * t, 2 * d)
        blocks = compress_batch(state, 0, req, pos, kv, sc, ratio=4)
        geom = PageGeometry(CODECS[name].fmt, 256 // 4)
        buf = torch.zeros(5, 1, geom.page_bytes, dtype=torch.uint8)
        slots = compressed_slots(table, blocks.req_slots, blocks.block_ids, geom.entries)
        assert slots[blocks.block_ids == 70][0] == 1 * 64 + 6      # request 1, block 70 -> page 1
        store(geom, buf, 0, slots, blocks.entries.bfloat16())
        codec = CODECS[name]
        want = codec.decode(codec.encode(blocks.entries.bfloat16()))
        assert torch.equal(gather(geom, buf, 0, slots), want)
        pools[name] = buf
    assert pools["fp8_ds_mla"][0].count_nonzero() == 0                # the null page stays untouched


def test_import_does_not_pull_triton():
    import subprocess
    import sys
    code = "import sys, kvatlas.datapath; assert 'triton' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
