from kvatlas import formats


def test_fp8_ds_mla_entry_and_page_rounding():
    f = formats.FP8_DS_MLA
    assert f.entry_bytes == 584 and f.payload_bytes == 583
    assert f.page_bytes(256) == 149_760 and f.page_bytes(256) / 256 == 585
    assert f.page_bytes(64) == 37_440 and f.page_bytes(64) / 64 == 585
    assert f.page_bytes(2) == 1_728 and f.page_bytes(2) / 2 == 864
    assert f.page_bytes(2) % 576 == 0
    # 2 entries carry 2 × 583 payload bytes; the rest of the 1,728 is dead
    assert f.page_pad_bytes(2) == 1_728 - 2 * 583


def test_other_row_formats():
    assert formats.BF16_KV.entry_bytes == 1024
    assert formats.UNIFORM_FP8_KV.entry_bytes == 512
    assert formats.UNIFIED_FP8_KV.entry_bytes == 640 and formats.UNIFIED_FP8_KV.parallel_bytes == 128
    assert formats.V41_SWA_KV.entry_bytes == 528
    assert formats.V41_COMPRESSED_KV.entry_bytes == 288
    assert formats.INDEXER_FORMATS["fp8"].entry_bytes == 132
    assert formats.INDEXER_FORMATS["fp4"].entry_bytes == 68
    assert formats.INDEXER_FORMATS["fp8"].page_bytes(64) == 64 * 132  # no page rounding for the indexer


def test_state_rings_and_write_pad():
    c4 = formats.c4_attention_ring(512, spec=False)
    assert (c4.width * 4, c4.rows, c4.write_pad) == (8192, 8, 0)
    c4s = formats.c4_attention_ring(512, spec=True)
    assert (c4s.rows, c4s.write_pad) == (16, 10)
    idx = formats.c4_indexer_ring(128, spec=False)
    assert idx.width * 4 == 2048
    c128 = formats.c128_ring(512, spec=False, online=False)
    assert (c128.width * 4, c128.rows, c128.write_pad) == (4096, 128, 0)
    assert formats.c128_ring(512, spec=True, online=False).write_pad == 130
    online = formats.c128_ring(512, spec=False, online=True)
    assert (online.width * 4, online.rows) == (6144, 1)
    assert formats.r2_pair_ring(512, 0).rows == 2
    assert formats.r2_pair_ring(512, 3).rows == 8  # smallest power of two ≥ 2 + 3
    assert formats.r2_pair_ring(512, 2).rows == 4


def test_fixed_state_cost_flash_matches_spec():
    # SPEC §4: C4 layer 8 × (8192 + 2048) = 80 KiB; C128 layer 128 × 4096 = 512 KiB
    c4 = formats.c4_attention_ring(512, False)
    idx = formats.c4_indexer_ring(128, False)
    c128 = formats.c128_ring(512, False, False)
    assert c4.rows * c4.width * 4 + idx.rows * idx.width * 4 == 80 * 1024
    assert c128.rows * c128.width * 4 == 512 * 1024
