"""A ledger of an engine's own pools, built as the SGLang plugin builds one but without SGLang:
a C4 KV pool (full pages), an SWA pool (SWA pages) and a request table (request slots)."""

from kvatlas.engines.base import EngineBuffer, paged_buffer, row_buffer
from kvatlas.integrations import foreign
from kvatlas.planning import formats


def _buffer(spec, index_space, in_kv_cache=True):
    layout = EngineBuffer(spec=spec, unreachable_units=0)
    return foreign.ForeignBuffer(layout=layout, tensor_bytes=layout.bytes, reserved_bytes=layout.bytes,
                                 physical_bytes=layout.bytes, planned_bytes=layout.bytes, index_space=index_space,
                                 bytes_per_used_unit=spec.unit_payload_bytes, in_kv_cache=in_kv_cache)


def sglang_like_ledger(used=None):
    used = {"full_pages": 2, "swa_pages": 3, "request_slots": 1} if used is None else used
    bufs = [_buffer(paged_buffer("c4_kv", pool="c4_kv", role="kv", kind="c4", layers=(2, 4), fmt=formats.FP8_DS_MLA,
                                 entries=64, pages=10, group="full_pages"), "full_pages"),
            _buffer(paged_buffer("swa_kv", pool="swa_kv", role="kv", kind="swa", layers=(0, 1, 2, 3, 4),
                                 fmt=formats.FP8_DS_MLA, entries=64, pages=12, group="swa_pages"), "swa_pages"),
            _buffer(row_buffer("req_to_token", pool="req_to_token", role="table", kind="all", layers=(), dtype="int32",
                               row_bytes=4 * 2048, rows=5, null_rows=1), "request_slots", in_kv_cache=False)]
    return foreign.ForeignLedger(engine="sglang", buffers=bufs, used_units=lambda: dict(used),
                                 units_total={"full_pages": 9, "swa_pages": 11, "request_slots": 4},
                                 labels={"tp_rank": 0, "pp_rank": 0, "dp_rank": 0}, budget_bytes=2_000_000,
                                 in_budget_pools=frozenset({"c4_kv", "swa_kv"}))
