"""One step's token indices on the device, and where each layer writes: the inputs of `write_layer`.

An engine runs a step layer by layer, so the indices of the step (the allocator's `WriteIndices`)
are moved to the device once, into tensors that keep their address from step to step: a CUDA
graph captured over a step's writes reads them, and the next step only refills them (`load`).

Per token the table holds: request slot, position, the first and last position of the token's
run in this step (a request's tokens are one run of consecutive positions: a decode token, a
prefill chunk, a verify batch of drafts), the SWA slot, and per compression ratio the entry the
token belongs to (`full_slot // r`, written only by the token that completes it). Per ratio it
also lists the tokens that complete a block, and (last row) how many: the allocator computes
these masks on the host anyway, so the device reads the count instead of every token asking;
the launch's size never depends on it, so a captured graph replays any step of the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..planning import formats
from .codecs import Codec, codec_for
from .compressor import CompressorSpec
from .errors import DataPathError, SlotError
from .geometry import PageGeometry
from .paged import gather_checked, store_checked

REQ, POS, FIRST, LAST, SWA = range(5)
_FIXED_ROWS = 5   # then per ratio: entry of each token, completing tokens; last row: their counts


def _runs(request_slots: np.ndarray, positions: np.ndarray):
    """(first, last) position of each token's run; checks that runs are consecutive positions."""
    n = len(positions)
    new = np.ones(n, dtype=bool)
    new[1:] = request_slots[1:] != request_slots[:-1]
    starts = np.flatnonzero(new)
    run = np.cumsum(new) - 1
    ends = np.append(starts[1:] - 1, n - 1)
    if n and (positions.min() < 0 or np.any((np.diff(positions) != 1) & ~new[1:])):
        raise DataPathError("positions", "a negative position, or a request's tokens not consecutive",
                            "pass the WriteIndices of one allocator call (or one forward())")
    if len(np.unique(request_slots[starts])) != len(starts):
        raise DataPathError("request_slots", "a request appears in two runs", "group each request's tokens")
    return positions[starts][run], positions[ends][run], int((ends - starts + 1).max(initial=0))


class StepIndices:
    """A step's indices on `device`, in persistent tensors for a fixed number of tokens.

    `table` is int64 [5 + 2·len(ratios) + 1, max(num_tokens, len(ratios))]; `max_run_tokens`
    (host) is the longest run, which decides whether a layer's write fits one launch."""

    def __init__(self, num_tokens: int, device, ratios=(4, 128)) -> None:
        if num_tokens < 1:
            raise DataPathError("num_tokens", f"{num_tokens}", "prepare indices for at least one token")
        self.ratios = tuple(sorted(set(ratios)))
        self.num_tokens = num_tokens
        self.device = torch.device(device)
        rows = _FIXED_ROWS + 2 * len(self.ratios) + 1
        cols = max(num_tokens, len(self.ratios))
        self.table = torch.zeros((rows, cols), dtype=torch.int64, device=self.device)
        self.device = self.table.device   # "cuda" -> "cuda:0": compared with the pools' devices
        pin = self.device.type == "cuda"
        self._host = torch.zeros((rows, cols), dtype=torch.int64, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None
        self.max_run_tokens = 0
        self.loaded = False

    @classmethod
    def of(cls, indices, device, ratios=None) -> "StepIndices":
        ratios = tuple(indices.compressed) if ratios is None else ratios
        return cls(indices.num_tokens, device, ratios).load(indices)

    def entry_row(self, ratio: int) -> int:
        if ratio not in self.ratios:
            raise DataPathError("ratio", f"{ratio} not among this step's ratios {self.ratios}",
                                "prepare StepIndices with every compression ratio the layers use")
        return _FIXED_ROWS + 2 * self.ratios.index(ratio)

    def done_row(self, ratio: int) -> int:
        """Row listing the tokens that complete a block of `ratio` (count: count_at(ratio))."""
        return self.entry_row(ratio) + 1

    @property
    def count_row(self) -> int:
        return self.table.shape[0] - 1

    def count_at(self, ratio: int) -> int:
        """Column of `count_row` holding the number of tokens that complete a block of `ratio`."""
        return self.ratios.index(ratio)

    def load(self, indices) -> "StepIndices":
        """Refill the table from an allocator `WriteIndices` (one host-to-device copy, no sync)."""
        if indices.num_tokens != self.num_tokens:
            raise DataPathError("indices", f"{indices.num_tokens} tokens, prepared for {self.num_tokens}",
                                "prepare StepIndices for this step's token count (or pad the batch)")
        missing = [r for r in self.ratios if r not in indices.compressed]
        if missing:
            raise DataPathError("indices", f"no entries of ratio {missing}", "prepare only the ratios this rank has")
        rs, pos = np.asarray(indices.request_slots), np.asarray(indices.positions)
        first, last, self.max_run_tokens = _runs(rs, pos)
        if self._copied is not None:
            self._copied.synchronize()   # the last step's copy may still read the staging buffer
        h, n = self._host.numpy(), self.num_tokens
        h[REQ, :n], h[POS, :n], h[FIRST, :n], h[LAST, :n], h[SWA, :n] = rs, pos, first, last, indices.swa_slots
        for r in self.ratios:
            h[self.entry_row(r), :n] = indices.compressed[r][1]
            done = np.flatnonzero((pos + 1) % r == 0)
            h[self.done_row(r), :len(done)] = done
            h[self.count_row, self.count_at(r)] = len(done)
        self.table.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.loaded = True
        return self

    def row(self, which: int) -> torch.Tensor:
        return self.table[which, :self.num_tokens]


@dataclass(frozen=True, slots=True, kw_only=True)
class PagedTarget:
    """One layer of a paged pool: entries land at `slot` of `buffer[:, layer]`."""
    geom: PageGeometry
    buffer: torch.Tensor
    layer: int
    codec: Codec
    parallel: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.geom.check_buffer(self.buffer)
        if not 0 <= self.layer < self.buffer.shape[1]:
            raise SlotError("layer", f"{self.layer} outside 0..{self.buffer.shape[1] - 1}", "pass a layer position")
        if self.geom.fmt.parallel_bytes and self.parallel is None:
            raise SlotError("parallel", f"{self.geom.fmt.name} keeps rope rows apart", "pass the '<pool>.rope' buffer")

    def store(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """`paged.store` of rows [n, width] into this layer, without the per-call checks (this
        target was checked when made; slots: int64 on the buffer's device, distinct)."""
        store_checked(self.codec, self.geom, self.buffer, range(self.layer, self.layer + 1), slots, values[None],
                      self.parallel)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """`paged.gather` of `slots` (any shape) from this layer, without the per-call checks."""
        out = gather_checked(self.codec, self.geom, self.buffer, range(self.layer, self.layer + 1),
                             slots.reshape(-1), self.parallel)
        return out.view(*slots.shape, self.codec.width)


@dataclass(frozen=True, slots=True, kw_only=True)
class RingTarget:
    """One layer of a compressor-state ring and the paged pool its completed entries go to."""
    state: torch.Tensor         # [slots, layers, ring, 2·coff·D]
    layer: int
    ratio: int
    pool: PagedTarget
    ape: torch.Tensor | None = None   # learned positional bias [ratio, coff·D]

    def __post_init__(self) -> None:
        spec = CompressorSpec.for_state(self.state, self.ratio)
        if not 0 <= self.layer < self.state.shape[1]:
            raise SlotError("layer", f"{self.layer} outside the state's layers", "pass a layer position")
        if spec.head_dim != self.pool.codec.width:
            raise DataPathError("state", f"head dim {spec.head_dim}, pool rows {self.pool.codec.width} wide",
                                "pair the ring with the pool of its entries")
        if self.ape is not None and tuple(self.ape.shape) != (self.ratio, spec.coff * spec.head_dim):
            raise DataPathError("ape", f"shape {tuple(self.ape.shape)}",
                                f"pass [{self.ratio}, {spec.coff * spec.head_dim}]")

    @property
    def spec(self) -> CompressorSpec:
        return CompressorSpec.for_state(self.state, self.ratio)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerTargets:
    """Everything one layer writes: its SWA entry, its attention compressor, its indexer."""
    swa: PagedTarget | None = None
    kv: RingTarget | None = None
    index: RingTarget | None = None

    @classmethod
    def of_cache(cls, cache, layer: int, *, ape=None, index_ape=None, tensors=None) -> "LayerTargets":
        """Targets of model layer `layer` of a V4 KVCache. `tensors` (pool name -> tensor) swaps a
        pool's tensor for another of the same shape, e.g. a copy to run a reference against."""
        return _of_cache(cache, layer, ape, index_ape, tensors or {})


def _row_format(opts, pool) -> formats.RowFormat:
    if pool.spec.role == "indexer":
        return formats.indexer_format(opts.indexer)
    lay = formats.layout(opts.kv_layout)
    return lay.swa if pool.spec.layer_kind == "swa" else lay.compressed


def _paged(cache, pool, layer, tensors) -> PagedTarget:
    fmt = _row_format(cache.plan.options, pool)
    rope = getattr(pool, "rope", None)   # unified layouts only; None elsewhere is the real value
    return PagedTarget(geom=PageGeometry(fmt, pool.spec.entries_per_unit), codec=codec_for(fmt),
                       buffer=tensors.get(pool.name, pool.tensor), layer=pool.layer_position(layer),
                       parallel=tensors.get(pool.name + ".rope", rope))


def _of_cache(cache, layer, ape, index_ape, tensors) -> LayerTargets:
    pools = cache.layer_pools(layer)
    if "swa_kv" not in pools:
        raise DataPathError("cache", "no paged SWA pool (a V4.1 layout?)",
                            "write V4.1 layers with store / compress_batch; write_layer covers V4 layouts")
    swa = _paged(cache, pools["swa_kv"], layer, tensors)
    rings = {}
    for kind, ratio in (("c4", 4), ("c128", 128)):
        for role, name, bias in (("kv", f"{kind}_kv", ape), ("index", f"{kind}_indexer", index_ape)):
            state = pools.get(f"{kind}_state" if role == "kv" else f"{kind}_indexer_state")
            if name not in pools:
                continue
            if state is None:
                raise DataPathError("cache", f"{name} has no ring state (online C128?)",
                                    "write_layer needs ring state; plan with online_c128 off")
            rings[role] = RingTarget(state=tensors.get(state.name, state.tensor), layer=state.layer_position(layer),
                                     ratio=ratio, pool=_paged(cache, pools[name], layer, tensors), ape=bias)
    return LayerTargets(swa=swa, kv=rings.get("kv"), index=rings.get("index"))
