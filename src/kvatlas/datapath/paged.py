"""store / gather: quantize rows into a paged pool buffer and read them back as bf16.

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
        raise DataPathError("values", f"dtype {values.dtype}", "pass bf16 (or fp32, rounded to bf16 first)")


def _cols(starts, width: int):
    return starts[:, None] + torch.arange(width, device=starts.device)


def _put(view, pages, starts, rows) -> None:
    if rows.shape[1]:
        view[pages[:, None], _cols(starts, rows.shape[1])] = rows


def _take(view, pages, starts, width: int):
    return view[pages[:, None], _cols(starts, width)]


def _store_torch(codec, geom, buffer, layer: int, slots, values, parallel) -> None:
    rows = codec.encode(values.to(torch.bfloat16))
    pages, offs = geom.split(slots.long())
    fmt = geom.fmt
    view = buffer[:, layer]
    _put(view, pages, offs * fmt.data_bytes, rows.data)
    _put(view, pages, geom.scale_region + offs * fmt.scale_bytes, rows.scale)
    if fmt.parallel_bytes:
        _put(parallel[:, layer], pages, offs * fmt.parallel_bytes, rows.parallel)


def _gather_torch(codec, geom, buffer, layer: int, slots, parallel):
    pages, offs = geom.split(slots.long())
    fmt, view = geom.fmt, buffer[:, layer]
    data = _take(view, pages, offs * fmt.data_bytes, fmt.data_bytes)
    scale = _take(view, pages, geom.scale_region + offs * fmt.scale_bytes, fmt.scale_bytes)
    par = (_take(parallel[:, layer], pages, offs * fmt.parallel_bytes, fmt.parallel_bytes)
           if fmt.parallel_bytes else data[:, :0])
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
    if slots.numel() == 0:
        return
    vals = values if multi else values[None]
    if use_triton(codec, buffer, impl, "store"):
        return kernels.store(codec, geom, buffer, lr, slots, vals)
    for i, layer in enumerate(lr):
        _store_torch(codec, geom, buffer, layer, slots, vals[i], parallel)


def gather(geom: PageGeometry, buffer, layers, slots, *, parallel=None, codec: Codec | None = None,
           validate: bool = True, impl: str = "auto"):
    """bf16 [*slots.shape, width] (or [len(layers), *slots.shape, width]) read from `slots`."""
    codec = _setup(geom, buffer, parallel, codec, impl)
    lr = _layer_range(layers, buffer)
    if validate:
        _check_slots(geom, buffer, slots)
    flat = slots.reshape(-1)
    if use_triton(codec, buffer, impl, "gather"):
        out = kernels.gather(codec, geom, buffer, lr, flat)
    else:
        out = torch.stack([_gather_torch(codec, geom, buffer, l, flat, parallel) for l in lr])
    out = out.reshape(len(lr), *slots.shape, codec.width)
    return out if not isinstance(layers, int) else out[0]
