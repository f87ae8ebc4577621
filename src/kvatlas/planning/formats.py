"""Every byte count of a cached entry lives here (SPEC §2, §4).

Other modules multiply what these functions return; a literal 584 anywhere else is a bug.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..units import round_up

FP8_DS_MLA_PAGE_ALIGN = 576  # FlashMLA requires a page's bytes to be a multiple of 576


@dataclass(frozen=True, slots=True, kw_only=True)
class RowFormat:
    """One cached entry's storage.

    A paged pool stores a page of P entries as a data region (P × data_bytes) then a scale region
    (P × scale_bytes), rounded up to page_align. `parallel_bytes` live in a second buffer
    (unified fp8 keeps rope rows apart from the nope rows).
    """

    name: str
    data_bytes: int
    scale_bytes: int = 0
    pad_bytes: int = 0          # per-entry padding inside the row (fp8_ds_mla's 8th scale byte)
    page_align: int = 1
    parallel_bytes: int = 0

    @property
    def entry_bytes(self) -> int:
        """Bytes one entry occupies, padding within the row included, parallel row included."""
        return self.data_bytes + self.scale_bytes + self.parallel_bytes

    @property
    def payload_bytes(self) -> int:
        """Bytes of one entry that carry information (no in-row pad)."""
        return self.entry_bytes - self.pad_bytes

    def page_bytes(self, entries: int) -> int:
        """Bytes of one page of `entries` entries in the main buffer (parallel buffer excluded)."""
        return round_up(entries * (self.data_bytes + self.scale_bytes), self.page_align)

    def parallel_page_bytes(self, entries: int) -> int:
        return entries * self.parallel_bytes

    def page_pad_bytes(self, entries: int) -> int:
        """Dead bytes of one page: alignment of the page plus the in-row pad of every entry."""
        return self.page_bytes(entries) - entries * (self.data_bytes + self.scale_bytes) + entries * self.pad_bytes


# KV latent rows (512 = 448 nope + 64 rope)
FP8_DS_MLA = RowFormat(name="fp8_ds_mla", data_bytes=448 + 128, scale_bytes=8, pad_bytes=1,
                       page_align=FP8_DS_MLA_PAGE_ALIGN)
BF16_KV = RowFormat(name="bf16", data_bytes=1024)
# the model's own float rows, bit for bit: what a float32 / float64 model computes, stored as it is
FP32_KV = RowFormat(name="fp32", data_bytes=2048)
FP64_KV = RowFormat(name="fp64", data_bytes=4096)
UNIFORM_FP8_KV = RowFormat(name="uniform_fp8", data_bytes=512)
# nope row: 448 fp8 + 7 exponent bytes + 57 pad in a 512-B row; rope 64 bf16 in a parallel buffer
UNIFIED_FP8_KV = RowFormat(name="unified_fp8", data_bytes=512, pad_bytes=512 - 448 - 7, parallel_bytes=128)
V41_SWA_KV = RowFormat(name="v41_fp8", data_bytes=512, scale_bytes=16)      # ue8m0 per 32
V41_COMPRESSED_KV = RowFormat(name="v41_fp4", data_bytes=256, scale_bytes=32)  # e4m3 scale per 16

# Lightning-indexer keys (128 wide)
INDEXER_FORMATS = {
    "fp8": RowFormat(name="indexer_fp8", data_bytes=128, scale_bytes=4),   # fp32 scale per 128
    "fp4": RowFormat(name="indexer_fp4", data_bytes=64, scale_bytes=4),    # ue8m0 per 32
    "bf16": RowFormat(name="indexer_bf16", data_bytes=256),
    "fp32": RowFormat(name="indexer_fp32", data_bytes=512),
    "fp64": RowFormat(name="indexer_fp64", data_bytes=1024),
}

STATE_DTYPES = {"fp32": 4, "bf16": 2, "fp64": 8}


@dataclass(frozen=True, slots=True, kw_only=True)
class KVLayout:
    """How the KV latent is stored. `window_rows` layouts keep SWA as per-request rows (V4.1)."""

    name: str
    swa: RowFormat
    compressed: RowFormat
    family: str = "v4"
    window_rows: bool = False
    default_indexer: str = "fp8"


LAYOUTS = {
    "v4": KVLayout(name="v4", swa=FP8_DS_MLA, compressed=FP8_DS_MLA),
    "bf16": KVLayout(name="bf16", swa=BF16_KV, compressed=BF16_KV),
    "uniform-fp8": KVLayout(name="uniform-fp8", swa=UNIFORM_FP8_KV, compressed=UNIFORM_FP8_KV),
    "fp32": KVLayout(name="fp32", swa=FP32_KV, compressed=FP32_KV, default_indexer="fp32"),
    "fp64": KVLayout(name="fp64", swa=FP64_KV, compressed=FP64_KV, default_indexer="fp64"),
    "unified-bf16": KVLayout(name="unified-bf16", swa=BF16_KV, compressed=BF16_KV),
    "unified-fp8": KVLayout(name="unified-fp8", swa=UNIFIED_FP8_KV, compressed=UNIFIED_FP8_KV),
    "v4.1": KVLayout(name="v4.1", swa=V41_SWA_KV, compressed=V41_COMPRESSED_KV, family="v4.1",
                     window_rows=True, default_indexer="fp4"),
    "v4.1-bf16": KVLayout(name="v4.1-bf16", swa=BF16_KV, compressed=BF16_KV, family="v4.1",
                          window_rows=True, default_indexer="bf16"),
}


# The vectors the formats store (SPEC §2): every KV layout holds DeepSeek-V4's 512-wide latent
# (fp8_ds_mla and unified fp8 split it 448 nope + 64 rope), every indexer format 128-wide keys.
KV_HEAD_DIM, ROPE_HEAD_DIM, INDEX_HEAD_DIM = 512, 64, 128
_SPLIT_ROPE = ("fp8_ds_mla", "unified_fp8")


def check_dims(model, lay: KVLayout, indexer: RowFormat) -> None:
    """Refuse a model whose vectors the layout's rows do not hold: planned as if they did, every
    byte count would be wrong (a head_dim of 256 priced as 512)."""
    def refuse(key: str, value: int, want: int, what: str):
        raise ConfigError(f"config.{key}", f"{value} is not supported: layout {lay.name} stores {what} of {want}",
                          f"plan a DeepSeek-V4 family model ({key} {want}); kvatlas has no format for others")
    if model.head_dim != KV_HEAD_DIM:
        refuse("head_dim", model.head_dim, KV_HEAD_DIM, "KV rows")
    if {lay.swa.name, lay.compressed.name} & set(_SPLIT_ROPE) and model.rope_head_dim != ROPE_HEAD_DIM:
        refuse("qk_rope_head_dim", model.rope_head_dim, ROPE_HEAD_DIM, "rope parts")
    if any(l.kind.has_indexer for l in model.layers()) and model.index_head_dim != INDEX_HEAD_DIM:
        refuse("index_head_dim", model.index_head_dim, INDEX_HEAD_DIM, f"indexer keys ({indexer.name})")


def layout(name: str) -> KVLayout:
    if name not in LAYOUTS:
        raise ConfigError("kv_layout", f"{name!r} is not a known layout", f"use one of {', '.join(LAYOUTS)}")
    return LAYOUTS[name]


def indexer_format(name: str) -> RowFormat:
    if name not in INDEXER_FORMATS:
        raise ConfigError("indexer", f"{name!r} is not a known indexer format",
                          f"use one of {', '.join(INDEXER_FORMATS)}")
    return INDEXER_FORMATS[name]


def state_itemsize(dtype: str) -> int:
    if dtype not in STATE_DTYPES:
        raise ConfigError("state_dtype", f"{dtype!r} is not supported", "use fp32, bf16 or fp64")
    return STATE_DTYPES[dtype]


# ---- compressor state (SPEC §4) ----------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class StateRing:
    """Per-request ring of one compressed layer: `rows` rows of `width` elements."""

    name: str
    width: int      # elements per row (kv and score halves together)
    rows: int
    window: int     # raw tokens one compressed entry is built from (sets the write pad)
    resume_rows: int = 0   # rows of the tokens before a page boundary that the next block reads
                           # (C4 overlap: the previous block's 4); what a prefix checkpoint saves

    @property
    def write_pad(self) -> int:
        """How many draft tokens the ring can absorb beyond the window (SPEC §4)."""
        return self.rows - self.window + 2 if self.rows > self.window else 0


def c4_attention_ring(head_dim: int, spec: bool) -> StateRing:
    return StateRing(name="c4_state", width=4 * head_dim, rows=16 if spec else 8, window=8, resume_rows=4)


def c4_indexer_ring(index_head_dim: int, spec: bool) -> StateRing:
    return StateRing(name="c4_indexer_state", width=4 * index_head_dim, rows=16 if spec else 8, window=8,
                     resume_rows=4)


def c128_ring(head_dim: int, spec: bool, online: bool) -> StateRing:
    if online:  # running max, running sum and weighted kv, one row
        return StateRing(name="c128_online_state", width=3 * head_dim, rows=1, window=128)
    return StateRing(name="c128_state", width=2 * head_dim, rows=256 if spec else 128, window=128)


def r2_pair_ring(head_dim: int, draft_tokens: int, name: str = "r2_state") -> StateRing:
    rows = 2
    while rows < 2 + draft_tokens:
        rows *= 2
    return StateRing(name=name, width=2 * head_dim, rows=rows if draft_tokens else 2, window=2)


def per_token_row_bytes(model, kv: RowFormat, indexer: RowFormat) -> float:
    """Growing KV per cached token from row sizes alone, no page padding (SPEC §5)."""
    total = 0.0
    for layer in model.layers():
        if layer.stores_compressed:
            total += kv.entry_bytes / layer.ratio
            if layer.kind.has_indexer:
                total += indexer.entry_bytes / layer.ratio
    return total
