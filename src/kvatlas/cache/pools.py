"""Pools over the arena: one class per role, each a thin, typed window on its buffers.

A pool never allocates: it holds the arena's views and knows how a model layer maps to its slice.
Buffers are unit-major ([unit, layer, ...]), so `layer(i)` is a strided view whose first dimension
is still the unit (page or request slot).
"""

from __future__ import annotations

from ..planning.buffers import BufferSpec


class Pool:
    role = "abstract"

    def __init__(self, name: str, specs: list[BufferSpec], tensors: dict) -> None:
        self.name = name
        self.specs = specs
        self.spec = specs[0]
        self.tensor = tensors[self.spec.name]
        self._pos = {layer: i for i, layer in enumerate(self.spec.layers)}

    @property
    def layers(self) -> tuple[int, ...]:
        return self.spec.layers

    def layer_position(self, layer: int) -> int:
        if layer not in self._pos:
            raise KeyError(f"layer {layer} has no slice in pool {self.name!r} (layers {list(self.spec.layers)})")
        return self._pos[layer]

    def layer(self, layer: int):
        """This layer's view, first dimension the unit."""
        return self.tensor[:, self.layer_position(layer)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, shape={tuple(self.tensor.shape)}, dtype={self.tensor.dtype})"


class PagedKVPool(Pool):
    """SWA or compressed KV in pages: [page, layer, page_bytes] uint8 (fp8_ds_mla, bf16, uniform fp8).
    Also the V4.1 low-ratio (r=1/2) source pools, which exist only on kv_source layers."""

    role = "kv"

    @property
    def entries_per_page(self) -> int:
        return self.spec.entries_per_unit


class UnifiedKVPool(PagedKVPool):
    """Unified rows: bf16 rows, or fp8 nope rows with the rope half in a parallel bf16 buffer."""

    def __init__(self, name, specs, tensors) -> None:
        super().__init__(name, specs, tensors)
        self.rope = tensors[specs[1].name] if len(specs) > 1 else None

    def rope_layer(self, layer: int):
        if self.rope is None:
            raise KeyError(f"pool {self.name!r} keeps rope inside its rows")
        return self.rope[:, self.layer_position(layer)]


class IndexerPool(PagedKVPool):
    """Lightning-indexer keys in pages (fp8 + fp32 scale, MXFP4, or bf16)."""

    role = "indexer"


class StatePool(Pool):
    """Compressor-state rings: [slot, layer, ring_rows, width] (C4 attention / indexer, C128
    offline ring or online row, V4.1 pair state)."""

    role = "state"

    @property
    def ring_rows(self) -> int:
        return self.spec.entries_per_unit


class CheckpointPool(Pool):
    """Prefix-cache resume points: [unit, layer, resume rows, width] — the rows of a per-request
    ring (C4 state overlap, V4.1 window) saved at a page boundary ("ckpt.<ring pool>")."""

    role = "checkpoint"


class WindowPool(Pool):
    """V4.1 request window: [slot, layer, window_rows × row_bytes] uint8."""

    role = "window"


class WorkspacePool(Pool):
    """V4.1 shared workspace for one prefill chunk's raw rows, one layer at a time."""

    role = "workspace"

    def layer(self, layer: int):
        return self.tensor[0]


class BlockTablePool(Pool):
    """Request slot → page ids (int32): the full-token table and the SWA page ring."""

    role = "table"

    def __init__(self, name, specs, tensors) -> None:
        super().__init__(name, specs, tensors)
        self.tables = {s.name.split(".", 1)[1]: tensors[s.name] for s in specs}


_BY_ROLE = {"kv": PagedKVPool, "indexer": IndexerPool, "state": StatePool, "window": WindowPool,
            "workspace": WorkspacePool, "table": BlockTablePool, "checkpoint": CheckpointPool}


def build_pools(plan, tensors: dict) -> dict[str, Pool]:
    """One pool per planned pool; the role picks the class (unified layouts use UnifiedKVPool)."""
    unified = plan.options.kv_layout.startswith("unified")
    out = {}
    for name, specs in plan.pools().items():
        cls = UnifiedKVPool if specs[0].role == "kv" and unified else _BY_ROLE[specs[0].role]
        out[name] = cls(name, specs, tensors)
    return out
