"""Engine ledgers built as the plugins build them but without the engines: an SGLang-like one (a
C4 KV pool of full pages, an SWA pool of SWA pages, a request table of request slots; with
`radix=True`, a radix cache beside it read through the plugin's own PrefixView) and a vLLM-like
pool layout (an SWA group and an MLA group over one block pool). `plugin_registries` exports
both as the plugins do: SGLang's through kvatlas's gauges, vLLM's through a board and its collector."""

import contextlib
import tempfile
from types import SimpleNamespace

from kvatlas.engines.base import EngineBuffer, paged_buffer, row_buffer
from kvatlas.integrations import foreign
from kvatlas.integrations.sglang import prefix as sglang_prefix
from kvatlas.integrations.vllm import ledger as vl
from kvatlas.integrations.vllm.census import Counts
from kvatlas.planning import formats

PAGE = 64


def _buffer(spec, index_space, in_kv_cache=True):
    layout = EngineBuffer(spec=spec, unreachable_units=0)
    return foreign.ForeignBuffer(layout=layout, tensor_bytes=layout.bytes, reserved_bytes=layout.bytes,
                                 physical_bytes=layout.bytes, planned_bytes=layout.bytes, index_space=index_space,
                                 bytes_per_used_unit=spec.unit_payload_bytes, in_kv_cache=in_kv_cache)


def _radix_view():
    """SGLang's radix cache as the plugin reads it: 1 full and 2 SWA pages evictable, 192 SWA tokens
    held of a cap-mode quota of 4 tails of window 128 + page 64 tokens."""
    alloc = SimpleNamespace(page_size=PAGE, size_swa=12 * PAGE, size_full=10 * PAGE,
                            full_available_size=lambda: 7 * PAGE)
    tree = SimpleNamespace(token_to_kv_pool_allocator=alloc, disable=False, full_evictable_size=lambda: PAGE,
                           swa_evictable_size=lambda: 2 * PAGE, swa_protected_size=lambda: PAGE)
    sglang_prefix.on_tree(None, tree)
    pricing = sglang_prefix.TailPricing(prefix_tails=4, tail_tokens=128 + PAGE, request_cap_tokens=5 * PAGE,
                                        cap_mode=True)
    return sglang_prefix.PrefixView(alloc, pricing)


def sglang_like_ledger(used=None, radix=False):
    used = {"full_pages": 2, "swa_pages": 3, "request_slots": 1} if used is None else used
    bufs = [_buffer(paged_buffer("c4_kv", pool="c4_kv", role="kv", kind="c4", layers=(2, 4), fmt=formats.FP8_DS_MLA,
                                 entries=PAGE, pages=10, group="full_pages"), "full_pages"),
            _buffer(paged_buffer("swa_kv", pool="swa_kv", role="kv", kind="swa", layers=(0, 1, 2, 3, 4),
                                 fmt=formats.FP8_DS_MLA, entries=PAGE, pages=12, group="swa_pages"), "swa_pages"),
            _buffer(row_buffer("req_to_token", pool="req_to_token", role="table", kind="all", layers=(), dtype="int32",
                               row_bytes=4 * 2048, rows=5, null_rows=1), "request_slots", in_kv_cache=False)]
    view = _radix_view() if radix else None
    return foreign.ForeignLedger(engine="sglang", buffers=bufs, used_units=lambda: dict(used),
                                 units_total={"full_pages": 9, "swa_pages": 11, "request_slots": 4},
                                 labels={"tp_rank": 0, "pp_rank": 0, "dp_rank": 0}, budget_bytes=2_000_000,
                                 in_budget_pools=frozenset({"c4_kv", "swa_kv"}),
                                 evictable_units=view.evictable_units if view else None,
                                 extra=view.extra_samples if view else None)


def vllm_like_layout():
    """17 blocks of 4,096 bytes (block 0 the null block): an SWA group (2,048 bytes of a block used)
    and an MLA group (C4 KV and indexer, 3,072 bytes of a block used); the rest of a block is pad."""
    swa = vl.GroupLayout(index=0, name="swa.0", layer_kind="swa", block_tokens=64, window=128, page_bytes=2048,
                         parts=(vl.KindPart(pool="swa_kv.0", role="kv", layer_kind="swa", layers=2,
                                            bytes_per_block=2048),),
                         request_blocks=3, planned_blocks=6)
    mla = vl.GroupLayout(index=1, name="mla", layer_kind="c4", block_tokens=256, window=None, page_bytes=3072,
                         parts=(vl.KindPart(pool="c4_kv", role="kv", layer_kind="c4", layers=2, bytes_per_block=2048),
                                vl.KindPart(pool="c4_indexer", role="indexer", layer_kind="c4", layers=2,
                                            bytes_per_block=1024)),
                         request_blocks=5, planned_blocks=10)
    return vl.PoolLayout(num_blocks=17, bytes_per_block=4096, allocation_bytes=17 * 4096, tensor_entries=3,
                         tensor_entries_bytes=3 * 17 * 4096, groups=(swa, mla), planned_free_blocks=1,
                         budget_bytes=None, labels={"tp_rank": "0", "pp_rank": "0", "dp_rank": "0"},
                         logged_tokens=None, logged_concurrency=None, cache_block_size=64, max_model_len=2048,
                         max_num_seqs=4, full_tokens=10 * 256)


# requests hold 3 SWA and 4 MLA blocks, the prefix cache keeps 1 and 2 more; 9 of the 16 usable free
VLLM_COUNTS = Counts(held=(3, 4), cached=(1, 2), unattributed=0, free=9, usable=16)


@contextlib.contextmanager
def plugin_registries():
    """{engine: a prometheus_client registry exporting what that engine's plugin adds to its /metrics}."""
    from prometheus_client import CollectorRegistry
    from kvatlas.integrations.boards import Board, BoardCollector
    foreign.write_gauges(sglang_like_ledger(radix=True).snapshot())
    regs = {"sglang": CollectorRegistry(auto_describe=False), "vllm": CollectorRegistry(auto_describe=False)}
    for g in foreign._GAUGES.values():
        regs["sglang"].register(g)
    sample_map = vl.SampleMap(vllm_like_layout())
    with tempfile.TemporaryDirectory() as folder:
        board = Board(folder, "vllm-dp0", sample_map.keys)
        try:
            board.write(sample_map.values(VLLM_COUNTS))
            regs["vllm"].register(BoardCollector(folder))
            yield regs
        finally:
            board.close()
