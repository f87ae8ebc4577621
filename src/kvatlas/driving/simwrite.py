"""Synthetic KV writes for the simulator: every WriteIndices the allocator returns is turned into
real stores through `kvatlas.datapath.store`, in the pools' real byte formats.

The values are a fixed bank of random bf16 rows, picked by (request slot, position), so a test can
recompute what a slot must hold and read it back with `gather`. Only paged KV / indexer pools and
the V4.1 per-request window are written; compressor-state rings are not (their numerics belong to
`datapath.compressor`, and the ledger counts their rows as occupied from admission on).

Writing every layer of every pool costs a quantization pass per layer; on CPU that dominates a
simulation, so `layers` caps the layer positions written per pool (the first N). On CUDA the
default is all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..planning import formats
from ..cache.pools import UnifiedKVPool
from ..planning.buffers import FULL_PAGES, REQUEST_SLOTS, SWA_PAGES
from ..datapath import DataPathError, PageGeometry, store
from ..planning.model import LayerKind

_BANK_ROWS = 4096


@dataclass(slots=True)
class _Target:
    pool: str
    geom: PageGeometry
    buffer: object
    parallel: object
    layers: range
    ratio: int          # 0: SWA slots; r ≥ 1: compressed entries of ratio r
    width: int          # 512 KV latent, 128 indexer key


def _row_format(plan, spec) -> formats.RowFormat:
    if spec.role == "indexer":
        return formats.indexer_format(plan.options.indexer)
    lay = formats.layout(plan.options.kv_layout)
    return lay.swa if spec.layer_kind == "swa" else lay.compressed


def _targets(cache, layers: int | None) -> tuple[list[_Target], dict[str, str]]:
    out, skipped = [], {}
    for name, pool in cache.pools.items():
        spec = pool.spec
        paged = spec.role in ("kv", "indexer") and spec.group in (SWA_PAGES, FULL_PAGES)
        window = spec.role == "window" and spec.group == REQUEST_SLOTS
        if not (paged or window):
            continue
        geom = PageGeometry(_row_format(cache.plan, spec), spec.entries_per_unit)
        parallel = pool.rope if isinstance(pool, UnifiedKVPool) else None
        try:
            geom.check_buffer(pool.tensor)
        except DataPathError as exc:
            skipped[name] = str(exc)
            continue
        n = len(spec.layers) if layers is None else min(layers, len(spec.layers))
        ratio = 0 if spec.layer_kind == "swa" else LayerKind(spec.layer_kind).ratio
        if n:
            out.append(_Target(name, geom, pool.tensor, parallel, range(0, n), ratio,
                               128 if spec.role == "indexer" else 512))
    return out, skipped


def _last_per_slot(slots, request_slots, positions):
    """A window ring (V4.1 per-request rows) is overwritten within one long prefill chunk: keep
    the last token written to each row, as the sequential writes would leave it."""
    rev = slots[::-1]
    _, first = np.unique(rev, return_index=True)
    if len(first) == len(slots):
        return slots, request_slots, positions
    keep = len(slots) - 1 - first
    return slots[keep], request_slots[keep], positions[keep]


class KVWriter:
    """Stores synthetic bf16 rows for each write of a KVCache. `layers=None`: every layer."""

    def __init__(self, cache, *, layers: int | None = 1, seed: int = 0) -> None:
        self.cache = cache
        self.targets, self.skipped = _targets(cache, layers)
        g = torch.Generator().manual_seed(seed)
        dev = cache.device
        self.bank = {w: torch.randn(_BANK_ROWS, w, generator=g).to(torch.bfloat16).to(dev) for w in (512, 128)}
        self.rows_written = 0

    @property
    def layers_written(self) -> dict[str, int]:
        return {t.pool: len(t.layers) for t in self.targets}

    def values(self, width: int, request_slots, positions):
        """The synthetic rows of (slot, position) pairs: a fixed function, so tests can check reads."""
        key = (np.asarray(request_slots) * 7919 + np.asarray(positions)) % _BANK_ROWS
        bank = self.bank[width]
        return bank.index_select(0, torch.from_numpy(key).to(bank.device))

    def write(self, idx) -> None:
        if idx.num_tokens == 0:
            return
        for t in self.targets:
            if t.ratio == 0:
                slots, rs, pos = _last_per_slot(idx.swa_slots, idx.request_slots, idx.positions)
            else:
                mask, entry = idx.compressed[t.ratio]
                if not mask.any():
                    continue
                slots, rs, pos = entry[mask], idx.request_slots[mask], idx.positions[mask] // t.ratio
            self._store(t, slots, rs, pos)

    def _store(self, t: _Target, slots, request_slots, positions) -> None:
        vals = self.values(t.width, request_slots, positions)
        multi = vals.unsqueeze(0).expand(len(t.layers), *vals.shape)
        dev_slots = torch.as_tensor(slots).to(t.buffer.device)
        # Inputs come from the allocator (distinct, in range) and a finite bank: skip the per-call
        # validation syncs, as a tuned engine loop would.
        store(t.geom, t.buffer, t.layers, dev_slots, multi, parallel=t.parallel, validate=False)
        self.rows_written += len(slots) * len(t.layers)
