"""Where every buffer lies in one address reservation, and which chunks each unit touches.

Pure arithmetic over the plan's buffer map, no CUDA: each buffer gets its own range starting on
a chunk (granularity) boundary, so a chunk never holds two buffers and unmapping one buffer's
chunk can never pull memory from under another. The cost is at most one chunk of tail per
buffer (9 buffers for V4-Flash: < 18 MiB of address space, no physical memory unless used).

Why unit-major buffers (see kvatlas.planning.buffers) matter here, with V4-Flash numbers at 2 MiB chunks:
one SWA page of all 43 layers is 43 × 37,440 = 1,609,920 B, one contiguous range, so it touches
at most 2 chunks (1.77 on average over alignments); one full-token page touches c4_kv
(21 × 37,440 = 786,240 B), c4_indexer (21 × 8,448 = 177,408 B) and c128_kv (20 × 1,728 = 34,560 B):
at most 6 chunks (3.48 on average). Laid out layer-major (one array per layer), the same pages
would touch one chunk per layer: at least 43 chunks per SWA page and 62 per full page, so every
new page could cost dozens of map calls and every chunk would empty only when all the pages of
all layers in it did. `chunks_per_unit()` computes these numbers for any plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..planning.buffers import WORKSPACE, BufferSpec
from ..units import round_up


@dataclass(frozen=True, slots=True)
class Placed:
    """One buffer in the reservation: byte offset (chunk-aligned), first chunk, chunk count."""

    spec: BufferSpec
    index: int
    offset_bytes: int
    first_chunk: int
    num_chunks: int


class ChunkLayout:
    """The plan's buffers, each from a chunk boundary; maps (group, unit ids) to chunk ids."""

    def __init__(self, buffers, granularity: int) -> None:
        if granularity <= 0 or granularity & (granularity - 1):
            raise ValueError(f"granularity {granularity} is not a power of two")
        self.granularity = granularity
        self.shift = granularity.bit_length() - 1
        self.placed: list[Placed] = []
        offset = 0
        for i, b in enumerate(buffers):
            span = round_up(b.bytes, granularity)
            self.placed.append(Placed(b, i, offset, offset >> self.shift, span >> self.shift))
            offset += span
        self.reserved_bytes = offset
        self.num_chunks = offset >> self.shift
        self.by_name = {p.spec.name: p for p in self.placed}
        self.buffer_of_chunk = np.repeat(np.arange(len(self.placed)), [p.num_chunks for p in self.placed])
        self.sentinel = self.num_chunks   # pads the tables below; ChunkMap keeps it "mapped, always live"
        # per index space, a table unit id → every chunk its buffers touch (padded with the sentinel),
        # so the allocator's hot path asks with ONE gather. Tables and the workspace are written
        # whole at start or by any prefill, so they stay mapped (pinned) and are not in here.
        self.tables: dict[str, np.ndarray] = {}
        for group in dict.fromkeys(p.spec.group for p in self.placed):
            parts = [self._unit_chunks(p) for p in self.placed
                     if p.spec.group == group and p.spec.units and not self._pinned_whole(p.spec)]
            if parts:
                self.tables[group] = np.hstack(parts)
        # the inverse, per chunk: which index space's units lie in it, as one id range
        # [unit_lo, unit_hi] (a chunk holds one buffer, and a buffer's units are contiguous);
        # group -1 for chunks outside the tables (block tables, workspace). ChunkMap uses it to
        # update its per-unit "every chunk live" flags when a chunk goes live or empty.
        names = list(self.tables)
        self.chunk_group = np.full(self.num_chunks, -1, np.int64)
        self.chunk_unit_lo = np.zeros(self.num_chunks, np.int64)
        self.chunk_unit_hi = np.zeros(self.num_chunks, np.int64)
        for p in self.placed:
            s = p.spec
            if p.spec.group not in self.tables or not s.units or self._pinned_whole(s):
                continue
            k = np.arange(p.num_chunks, dtype=np.int64)
            sl = slice(p.first_chunk, p.first_chunk + p.num_chunks)
            self.chunk_group[sl] = names.index(s.group)
            self.chunk_unit_lo[sl] = (k << self.shift) // s.unit_bytes
            self.chunk_unit_hi[sl] = np.minimum((((k + 1) << self.shift) - 1) // s.unit_bytes, s.units - 1)
        self.group_names = names

    def _unit_chunks(self, p: Placed) -> np.ndarray:
        """[units, most chunks a unit can touch]: chunk ids of every unit of one buffer."""
        ub = p.spec.unit_bytes
        start = np.arange(p.spec.units, dtype=np.int64) * ub
        lo = (start >> self.shift) + p.first_chunk
        hi = ((start + (ub - 1)) >> self.shift) + p.first_chunk
        grid = lo[:, None] + np.arange(chunks_per_unit_max(ub, self.granularity))
        return np.where(grid <= hi[:, None], grid, self.sentinel)

    @staticmethod
    def _pinned_whole(spec: BufferSpec) -> bool:
        return spec.role == "table" or spec.group == WORKSPACE

    def pinned_chunks(self) -> np.ndarray:
        """Chunks mapped for the arena's whole life: every buffer's null units (zeroed at start),
        whole block tables (zeroed at start) and the workspace (written by any prefill)."""
        out = []
        for p in self.placed:
            if self._pinned_whole(p.spec):
                out.append(np.arange(p.first_chunk, p.first_chunk + p.num_chunks))
            elif p.spec.null_units and p.spec.units:
                out.append(self._unit_chunks(p)[: p.spec.null_units].ravel())
        chunks = np.unique(np.concatenate(out)) if out else np.zeros(0, np.int64)
        return chunks[chunks != self.sentinel]

    def chunks_of(self, group: str, ids: np.ndarray) -> np.ndarray:
        """Chunk ids touched by units `ids` of every buffer of `group`, one per unit and chunk
        (repeats kept: the reference counts need them), padded with `sentinel`."""
        table = self.tables.get(group)
        return table[ids].ravel() if table is not None else np.zeros(0, np.int64)


def chunks_per_unit_max(unit_bytes: int, granularity: int) -> int:
    """Most chunks one contiguous range of unit_bytes can touch, over every alignment."""
    return 1 if unit_bytes <= 1 else (unit_bytes - 2) // granularity + 2


def chunks_per_unit_mean(unit_bytes: int, granularity: int) -> float:
    """Chunks touched on average when the range starts at a uniformly random byte offset."""
    return (unit_bytes - 1) / granularity + 1


def chunks_per_unit(specs, granularity: int) -> dict:
    """Chunks one unit of an index space touches, unit-major (as allocated) against layer-major
    (one array per layer), summed over the buffers of the space: {max, mean, layer_major_min}."""
    out = {"max": 0, "mean": 0.0, "layer_major_min": 0, "layer_major_mean": 0.0}
    for s in specs:
        per_layer = s.unit_bytes // max(len(s.layers), 1)
        out["max"] += chunks_per_unit_max(s.unit_bytes, granularity)
        out["mean"] += chunks_per_unit_mean(s.unit_bytes, granularity)
        out["layer_major_min"] += max(len(s.layers), 1)
        out["layer_major_mean"] += max(len(s.layers), 1) * chunks_per_unit_mean(per_layer, granularity)
    return out


__all__ = ["ChunkLayout", "Placed", "chunks_per_unit", "chunks_per_unit_max"]
