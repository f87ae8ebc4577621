"""The buffer map: every buffer a plan allocates, with its shape, bytes and dead bytes.

Layout choice: every buffer is unit-major — [unit, layer, ...] where a unit is a page (SWA or
full-token), a request slot, or the workspace. One allocator page of one pool is then a single
contiguous range across all layers, which keeps a request's data dense: good for a VMM backend
(one page touches one or two 2-MiB chunks, not one chunk per layer) and for freeing. A layer's
view is a strided slice, which paged attention kernels accept (page stride ≠ page bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import formats
from .model import LayerKind, LayerSpec
from ..units import round_up

BUFFER_ALIGN = 512  # every buffer starts and ends on 512 B, the CUDA caching allocator's rounding
# The whole map ends on 2 MiB: the CUDA caching allocator hands a large request its whole
# segment (2 MiB-rounded) unless more than 1 MiB would be left over, so an unaligned total makes
# memory_allocated() grow by more than the tensor. 2 MiB is also the VMM mapping granularity.
SLAB_ALIGN = 2 << 20

# index spaces a buffer's units come from
SWA_PAGES, FULL_PAGES, REQUEST_SLOTS, WORKSPACE = "swa_pages", "full_pages", "request_slots", "workspace"
# prefix-cache resume points: the rows of per-request rings that resuming at a page boundary reads
CHECKPOINTS = "checkpoints"


@dataclass(frozen=True, slots=True, kw_only=True)
class BufferSpec:
    name: str
    pool: str
    group: str              # which index space the first dimension counts
    role: str               # kv / indexer / state / window / workspace / table
    layer_kind: str         # swa / c4 / c128 / r2 / r1 / all
    layers: tuple[int, ...]
    dtype: str              # uint8 / float32 / bfloat16 / float64 / int32
    inner_shape: tuple[int, ...]  # per unit, in dtype elements, layer dimension first where layered
    unit_bytes: int         # bytes of one unit (all layers)
    unit_payload_bytes: int  # of those, bytes that can hold data (no page or row pad)
    entries_per_unit: int   # entries (rows, tokens) one unit holds per layer
    entry_bytes: int        # bytes of one entry's payload in this buffer
    null_units: int = 1     # unit 0 is the null target for padded writes
    units: int = 0
    offset_bytes: int = 0
    tail_bytes: int = 0     # the last buffer carries the pad that ends the map on SLAB_ALIGN

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.units, *self.inner_shape)

    @property
    def data_bytes(self) -> int:
        return self.units * self.unit_bytes

    @property
    def bytes(self) -> int:
        return round_up(self.data_bytes, BUFFER_ALIGN) + self.tail_bytes

    @property
    def addressable_units(self) -> int:
        return max(self.units - self.null_units, 0)

    @property
    def addressable_bytes(self) -> int:
        return self.addressable_units * self.unit_payload_bytes

    @property
    def null_bytes(self) -> int:
        return min(self.null_units, self.units) * self.unit_bytes

    @property
    def padding_bytes(self) -> int:
        """Dead bytes other than the null unit: page rounding, row pad, buffer alignment."""
        return self.bytes - self.addressable_bytes - self.null_bytes

    @property
    def dead_bytes(self) -> int:
        return self.bytes - self.addressable_bytes

    def to_dict(self) -> dict:
        return {
            "name": self.name, "pool": self.pool, "group": self.group, "role": self.role,
            "layer_kind": self.layer_kind, "layers": list(self.layers), "dtype": self.dtype,
            "shape": list(self.shape), "offset_bytes": self.offset_bytes, "bytes": self.bytes,
            "padding_bytes": self.padding_bytes, "null_bytes": self.null_bytes,
            "addressable_bytes": self.addressable_bytes,
            "addressable_entries": self.addressable_units * self.entries_per_unit * max(len(self.layers), 1),
            "entry_bytes": self.entry_bytes,
        }


_ITEMSIZE = {"uint8": 1, "int32": 4, "float32": 4, "bfloat16": 2, "float64": 8}
_STATE_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp64": "float64"}


def itemsize(dtype: str) -> int:
    return _ITEMSIZE[dtype]


def _paged(name, pool, group, role, kind, layers, fmt: formats.RowFormat, entries: int, parallel=False):
    n = len(layers)
    if parallel:
        page = fmt.parallel_page_bytes(entries)
        payload = page
        entry = fmt.parallel_bytes
    else:
        page = fmt.page_bytes(entries)
        entry = fmt.data_bytes + fmt.scale_bytes - fmt.pad_bytes
        payload = entries * entry
    return BufferSpec(name=name, pool=pool, group=group, role=role, layer_kind=kind, layers=layers,
                      dtype="uint8", inner_shape=(n, page), unit_bytes=n * page, unit_payload_bytes=n * payload,
                      entries_per_unit=entries, entry_bytes=entry)


def _kv_pool(pool, group, kind, layers, fmt, entries, role="kv"):
    out = [_paged(pool, pool, group, role, kind, layers, fmt, entries)]
    if fmt.parallel_bytes:
        out.append(_paged(f"{pool}.rope", pool, group, role, kind, layers, fmt, entries, parallel=True))
    return out


def _state(ring: formats.StateRing, kind, layers, state_dtype: str, checkpoint: bool = False):
    """A request's ring, or (checkpoint) the ring's resume rows saved at a page boundary."""
    dtype = _STATE_DTYPE[state_dtype]
    n, size = len(layers), itemsize(dtype)
    row = ring.width * size
    rows = ring.resume_rows if checkpoint else ring.rows
    name = f"ckpt.{ring.name}" if checkpoint else ring.name
    return BufferSpec(name=name, pool=name, group=CHECKPOINTS if checkpoint else REQUEST_SLOTS,
                      role="checkpoint" if checkpoint else "state", layer_kind=kind,
                      layers=layers, dtype=dtype, inner_shape=(n, rows, ring.width),
                      unit_bytes=n * rows * row, unit_payload_bytes=n * rows * row,
                      entries_per_unit=rows, entry_bytes=row)


def _table(name, pages_per_request):
    return BufferSpec(name=name, pool="block_table", group=REQUEST_SLOTS, role="table", layer_kind="all",
                      layers=(), dtype="int32", inner_shape=(pages_per_request,),
                      unit_bytes=4 * pages_per_request, unit_payload_bytes=4 * pages_per_request,
                      entries_per_unit=pages_per_request, entry_bytes=4)


def templates(model, opts, layers: tuple[LayerSpec, ...], sizing):
    """The buffers of one rank, before their unit counts are known."""
    window_rows, workspace_rows = sizing.window_rows, sizing.workspace_rows
    lay = formats.layout(opts.kv_layout)
    idx = formats.indexer_format(opts.indexer)
    spec = opts.draft_tokens > 0
    page = opts.page_tokens
    out: list[BufferSpec] = []
    all_ids = tuple(layer.index for layer in layers)
    ckpt = opts.prefix_checkpoints > 0
    if lay.window_rows:
        fmt = lay.swa
        row = fmt.entry_bytes
        if ckpt:   # the window - 1 raw rows before a boundary, saved as the window holds them
            tail = model.sliding_window - 1
            out.append(BufferSpec(name="ckpt.swa_window", pool="ckpt.swa_window", group=CHECKPOINTS,
                                  role="checkpoint", layer_kind="swa", layers=all_ids, dtype="uint8",
                                  inner_shape=(len(all_ids), tail * row), unit_bytes=len(all_ids) * tail * row,
                                  unit_payload_bytes=len(all_ids) * tail * (row - fmt.pad_bytes),
                                  entries_per_unit=tail, entry_bytes=row - fmt.pad_bytes))
        out.append(BufferSpec(name="swa_window", pool="swa_window", group=REQUEST_SLOTS, role="window",
                              layer_kind="swa", layers=all_ids, dtype="uint8",
                              inner_shape=(len(all_ids), window_rows * row),
                              unit_bytes=len(all_ids) * window_rows * row,
                              unit_payload_bytes=len(all_ids) * window_rows * (row - fmt.pad_bytes),
                              entries_per_unit=window_rows, entry_bytes=row - fmt.pad_bytes))
        out.append(BufferSpec(name="swa_workspace", pool="swa_workspace", group=WORKSPACE, role="workspace",
                              layer_kind="swa", layers=(), dtype="uint8", inner_shape=(workspace_rows * row,),
                              unit_bytes=workspace_rows * row, unit_payload_bytes=workspace_rows * row,
                              entries_per_unit=workspace_rows, entry_bytes=row, null_units=0))
    else:
        out += _kv_pool("swa_kv", SWA_PAGES, "swa", all_ids, lay.swa, opts.swa_page_tokens)
    for kind in (LayerKind.C4, LayerKind.C128, LayerKind.R2, LayerKind.R1):
        ids = tuple(l.index for l in layers if l.kind is kind and l.stores_compressed)
        if not ids:
            continue
        entries = page // kind.ratio
        out += _kv_pool(f"{kind.value}_kv", FULL_PAGES, kind.value, ids, lay.compressed, entries)
        if kind.has_indexer:
            out.append(_paged(f"{kind.value}_indexer", f"{kind.value}_indexer", FULL_PAGES, "indexer",
                              kind.value, ids, idx, entries))
        for ring in _rings(model, opts, kind, spec):
            out.append(_state(ring, kind.value, ids, opts.state_dtype))
            if ckpt and ring.resume_rows:
                out.append(_state(ring, kind.value, ids, opts.state_dtype, checkpoint=True))
    if any(t.group == FULL_PAGES for t in out):
        out.append(_table("block_table.full", sizing.pages_per_request))
    if not lay.window_rows:  # a ring: logical SWA page j of a request sits at entry j % ring pages
        out.append(_table("block_table.swa", sizing.swa_ring_pages))
    return out


def state_rings(model, opts, kind: LayerKind) -> list[formats.StateRing]:
    """The compressor-state rings a layer kind keeps per request under these options."""
    return _rings(model, opts, kind, opts.draft_tokens > 0)


def _rings(model, opts, kind: LayerKind, spec: bool) -> list[formats.StateRing]:
    if kind is LayerKind.C4:
        return [formats.c4_attention_ring(model.head_dim, spec), formats.c4_indexer_ring(model.index_head_dim, spec)]
    if kind is LayerKind.C128:
        return [formats.c128_ring(model.head_dim, spec, opts.online_c128)]
    if kind is LayerKind.R2:
        return [formats.r2_pair_ring(model.head_dim, opts.draft_tokens),
                formats.r2_pair_ring(model.index_head_dim, opts.draft_tokens, name="r2_indexer_state")]
    return []


def slab_bytes(tmpls: list[BufferSpec], units: dict[str, int]) -> int:
    """Total bytes of the map for these unit counts (what materialise() will lay out)."""
    return round_up(sum(round_up(units[t.group] * t.unit_bytes, BUFFER_ALIGN) for t in tmpls), SLAB_ALIGN)


def materialise(tmpls: list[BufferSpec], units: dict[str, int]) -> tuple[BufferSpec, ...]:
    """Give every buffer its unit count and its offset in one contiguous slab."""
    out, offset = [], 0
    for t in tmpls:
        b = replace(t, units=units[t.group], offset_bytes=offset)
        offset += b.bytes
        out.append(b)
    if out:
        out[-1] = replace(out[-1], tail_bytes=round_up(offset, SLAB_ALIGN) - offset)
    return tuple(out)
