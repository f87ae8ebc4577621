"""store / gather: quantize rows into a paged pool buffer and read them back as bf16 (the float
formats fp32 / fp64 keep and give their own dtype, bit for bit).

Buffers are the unit-major tensors of `buffers.py`: uint8 [units, n_layers, page_bytes], and for
formats with parallel rows a second uint8 [units, n_layers, P * parallel_bytes]. `layers` is one
layer position (values [n, width]) or a `range` of positions (values [len, n, width]): one call
over many layers lets a GPU kernel cover a decode step's layers at once.

Slots must be distinct and lie past page 0, the null page: every unused block-table entry points
there and readers expect it to hold zeros. A padded write that targets it on purpose says so
(`allow_null=True`); its slots may repeat, and what lands there is garbage by definition. With
`validate=True` (the default) a call
checks shapes, slot range, distinctness and finiteness before touching the buffer, so a refused
call writes nothing; each check costs a device sync, so a tuned hot loop may pass validate=False,
and then non-finite input leaves unspecified bytes in the written entries (and only in them).
"""

from __future__ import annotations

import torch

from . import kernels
from .codecs import Codec, Rows, codec_for
from .errors import DataPathError, NonFiniteError, OutOfRangeError, SlotError
from .geometry import PageGeometry


def _layer_range(layers, buffer) -> range:
    r = range(layers, layers + 1) if isinstance(layers, int) else layers
    if not isinstance(r, range) or r.step != 1 or len(r) == 0:
        raise SlotError("layers", f"{layers!r}", "pass a layer position or a non-empty range(start, stop)")
    if r.start < 0 or r.stop > buffer.shape[1]:
        raise SlotError("layers", f"{layers!r} outside 0..{buffer.shape[1] - 1}", "pass positions within the buffer")
    return r


def _check_slots(geom: PageGeometry, buffer, slots) -> None:
    if slots.dtype not in (torch.int32, torch.int64) or slots.device != buffer.device:
        raise SlotError("slots", f"{slots.dtype} on {slots.device}", f"pass int32/int64 slots on {buffer.device}")
    if slots.numel() == 0:
        return
    lo, hi = int(slots.min()), int(slots.max())
    if lo < 0 or hi >= geom.num_slots(buffer):
        raise SlotError("slots", f"range {lo}..{hi} outside 0..{geom.num_slots(buffer) - 1}",
                        "allocate pages first; slot = page_id * entries_per_page + offset")


def _check_store(codec: Codec, geom, buffer, slots, values, allow_null: bool) -> None:
    _check_slots(geom, buffer, slots)
    if not allow_null and slots.numel() and int(slots.min()) < geom.entries:
        raise SlotError("slots", f"slot {int(slots.min())} is in the null page (slots 0..{geom.entries - 1}), "
                        "which unused block-table entries point at", "write to pages the allocator handed out, "
                        "or pass allow_null=True for padded writes that target the null page on purpose")
    live = slots[slots >= geom.entries]
    if live.numel() != torch.unique(live).numel():
        raise SlotError("slots", "a slot repeats outside the null page", "write each entry once per call")
    if not torch.isfinite(values).all():
        raise NonFiniteError("values", "NaN or Inf in the rows to store",
                             "fix the producer; no scale represents a non-finite value")
    if codec.max_abs != float("inf") and values.numel() and float(values.abs().max()) > codec.max_abs:
        raise OutOfRangeError("values", f"|x| exceeds {codec.max_abs:g}, the most {codec.fmt.name} holds",
                              "scale the values down (or, for uniform fp8, raise the pool scale)")


def _shape_check(codec: Codec, values, slots, n_layers: int, multi: bool) -> None:
    want = (n_layers, slots.shape[0], codec.width) if multi else (slots.shape[0], codec.width)
    if slots.dim() != 1 or tuple(values.shape) != want:
        raise DataPathError("values", f"shape {tuple(values.shape)} with slots {tuple(slots.shape)}",
                            f"pass 1-D slots and values of shape {want}")
    if not values.is_floating_point():
        raise DataPathError("values", f"dtype {values.dtype}",
                            f"pass {codec.dtype} (or any float dtype, rounded to {codec.dtype} first)")


_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def _region(view, start: int, entries: int, width: int):
    """Entries [units, entries, width] of a region of one layer's pages ([units, page_bytes]): each
    entry's bytes are contiguous in its region, so a row is one index, not `width` byte indices;
    and they are moved as the widest integers their width and alignment allow (a copy of 8-byte
    words, not of single bytes). Returns (entries, the integer dtype or None for bytes)."""
    r = view[:, start:start + entries * width]
    for k, dt in _WIDE:
        if width % k == 0 and r.storage_offset() % k == 0 and r.stride(0) % k == 0:
            return r.view(dt).unflatten(-1, (entries, width // k)), dt
    return r.unflatten(-1, (entries, width)), None


def _put(view, start: int, entries: int, pages, offs, rows) -> None:
    region, dt = _region(view, start, entries, rows.shape[1])
    region[pages, offs] = rows.contiguous().view(dt) if dt is not None else rows


def _take(view, start: int, entries: int, pages, offs, width: int):
    region, dt = _region(view, start, entries, width)
    got = region[pages, offs]
    return got.view(torch.uint8) if dt is not None else got


def _store_torch(codec, geom, buffer, layer: int, slots, values, parallel) -> None:
    rows = codec.encode(values.to(codec.dtype))
    pages, offs = geom.split(slots.long())
    fmt, view, P = geom.fmt, buffer[:, layer], geom.entries
    _put(view, 0, P, pages, offs, rows.data)
    if fmt.scale_bytes:
        _put(view, geom.scale_region, P, pages, offs, rows.scale)
    if fmt.parallel_bytes:
        _put(parallel[:, layer], 0, P, pages, offs, rows.parallel)


def _gather_torch(codec, geom, buffer, layer: int, slots, parallel):
    pages, offs = geom.split(slots.long())
    fmt, view, P = geom.fmt, buffer[:, layer], geom.entries
    data = _take(view, 0, P, pages, offs, fmt.data_bytes)
    scale = _take(view, geom.scale_region, P, pages, offs, fmt.scale_bytes) if fmt.scale_bytes else data[:, :0]
    par = _take(parallel[:, layer], 0, P, pages, offs, fmt.parallel_bytes) if fmt.parallel_bytes else data[:, :0]
    return codec.decode(Rows(data, scale, par))


def _setup(geom, buffer, parallel, codec, impl):
    geom.check_buffer(buffer)
    if geom.fmt.parallel_bytes:
        if parallel is None:
            raise SlotError("parallel", f"{geom.fmt.name} keeps rope rows in a second buffer",
                            "pass the pool's '<pool>.rope' buffer as parallel=")
        geom.check_buffer(parallel, "parallel", parallel=True)
    if impl not in ("auto", "torch", "triton"):
        raise DataPathError("impl", f"{impl!r}", "use auto, torch or triton")
    return codec or codec_for(geom.fmt)


def use_triton(codec: Codec, buffer, impl: str, op: str) -> bool:
    ok = buffer.is_cuda and kernels.supports(codec, op)
    if impl == "triton" and not ok:
        raise DataPathError("impl", f"no Triton {op} for {codec.fmt.name} on {buffer.device}",
                            "use impl='auto' or 'torch'")
    return ok and impl != "torch"


def store(geom: PageGeometry, buffer, layers, slots, values, *, parallel=None, codec: Codec | None = None,
          validate: bool = True, impl: str = "auto", allow_null: bool = False) -> None:
    """Quantize `values` (bf16 [n, width], or [len(layers), n, width]) into `slots` of `layers`."""
    codec = _setup(geom, buffer, parallel, codec, impl)
    lr = _layer_range(layers, buffer)
    multi = not isinstance(layers, int)
    _shape_check(codec, values, slots, len(lr), multi)
    if validate:
        _check_store(codec, geom, buffer, slots, values, allow_null)
    store_checked(codec, geom, buffer, lr, slots, values if multi else values[None], parallel, impl)


def store_checked(codec: Codec, geom: PageGeometry, buffer, lr: range, slots, vals, parallel=None,
                  impl: str = "auto") -> None:
    """`store` past its checks (vals [len(lr), n, width]): for callers that checked the target once
    (a PagedTarget) and write a pass's rows layer by layer."""
    if slots.numel() == 0:
        return
    if use_triton(codec, buffer, impl, "store"):
        return kernels.store(codec, geom, buffer, lr, slots, vals)
    for i, layer in enumerate(lr):
        _store_torch(codec, geom, buffer, layer, slots, vals[i], parallel)


def gather_checked(codec: Codec, geom: PageGeometry, buffer, lr: range, flat, parallel=None, impl: str = "auto"):
    """`gather` past its checks: [len(lr), len(flat), width] from 1-D slots `flat`."""
    if use_triton(codec, buffer, impl, "gather"):
        return kernels.gather(codec, geom, buffer, lr, flat)
    return torch.stack([_gather_torch(codec, geom, buffer, l, flat, parallel) for l in lr])


def gather(geom: PageGeometry, buffer, layers, slots, *, parallel=None, codec: Codec | None = None,
           validate: bool = True, impl: str = "auto"):
    """codec.dtype (bf16 but for the float formats) [*slots.shape, width] (or [len(layers),
    *slots.shape, width]) read from `slots`."""
    codec = _setup(geom, buffer, parallel, codec, impl)
    lr = _layer_range(layers, buffer)
    if validate:
        _check_slots(geom, buffer, slots)
    out = gather_checked(codec, geom, buffer, lr, slots.reshape(-1), parallel, impl)
    out = out.reshape(len(lr), *slots.shape, codec.width)
    return out if not isinstance(layers, int) else out[0]


def layer_ops(target, layers: int = 1):
    """For a PagedTarget whose format has Triton kernels and lives on CUDA: an object whose
    `store(slots, values)` and `gather(slots)` (1-D int64 slots) are `target.store`/`gather` with
    the fixed arguments made once (kernels.codec_triton.LayerOps); None elsewhere. `layers` > 1:
    its gather reads that many layers of the pool from the target's on, in one launch."""
    if not use_triton(target.codec, target.buffer, "auto", "store"):
        return None
    return kernels.layer_ops(target.codec, target.geom, target.buffer, target.layer, layers)


def entries_view(geom: PageGeometry, buffer, layer: int | range, *, codec: Codec | None = None):
    """One layer's entries as values, [units, entries per page, width] in the codec's dtype, for
    formats that store values as they are (bf16, fp32, fp64: `Codec.raw`); None for the others.
    A range of layers: theirs, [units, layers, entries per page, width].
    Indexing it with (page, offset) pairs is `gather` for those formats, assigning to it `store`
    without the checks: a caller that writes a pass's rows layer by layer with slots it split once
    pays one indexing operation a call instead of the checks and the split each time."""
    codec = codec or codec_for(geom.fmt)
    geom.check_buffer(buffer)
    if not codec.raw:
        return None
    at = layer if isinstance(layer, int) else slice(layer.start, layer.stop)
    return buffer[:, at, : geom.entries * geom.fmt.data_bytes].view(codec.dtype).unflatten(
        -1, (geom.entries, codec.width))

