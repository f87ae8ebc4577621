"""What every engine model returns: a buffer map in kvatlas's terms plus what the engine reports.

An engine's tensors are not kvatlas's slab, so an `EngineBuffer` wraps a `BufferSpec` and adds
what the spec cannot say on its own: units the engine allocates but its addressing can never
reach (`unreachable_units`), and whether the engine counted the buffer against the budget it
sized from (`in_budget`). Its bytes are the exact tensor bytes (`data_bytes`), not rounded to
kvatlas's 512-B buffer alignment, because engines allocate one tensor per layer or one backing
tensor, not one aligned slab.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..planning import formats
from ..planning.buffers import BufferSpec
from ..errors import ConfigError

# contexts the table shows, and the ones the concurrency curve is drawn over
TABLE_CONTEXTS = (8192, 131072, 1048576)
CURVE_CONTEXTS = tuple(2**k for k in range(10, 21))


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineBuffer:
    spec: BufferSpec
    unreachable_units: int = 0   # allocated units no index the engine computes can ever reach
    in_budget: bool = True       # False: allocated beside the KV budget (tables, index maps)
    aligned: bool = False        # True: a kvatlas slab buffer, which really spans its 512-B rounding
    note: str = ""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pool(self) -> str:
        return self.spec.pool

    @property
    def bytes(self) -> int:
        return self.spec.bytes if self.aligned else self.spec.data_bytes

    @property
    def reachable_units(self) -> int:
        return max(self.spec.units - self.spec.null_units - self.unreachable_units, 0)

    @property
    def reachable_bytes(self) -> int:
        return self.reachable_units * self.spec.unit_payload_bytes

    @property
    def unreachable_bytes(self) -> int:
        return self.unreachable_units * self.spec.unit_bytes

    @property
    def null_bytes(self) -> int:
        return min(self.spec.null_units, self.spec.units) * self.spec.unit_bytes

    @property
    def dead_bytes(self) -> int:
        return self.bytes - self.reachable_bytes

    @property
    def padding_bytes(self) -> int:
        return self.dead_bytes - self.unreachable_bytes - self.null_bytes

    def to_dict(self) -> dict:
        s = self.spec
        return {"name": s.name, "pool": s.pool, "role": s.role, "layer_kind": s.layer_kind,
                "num_layers": len(s.layers), "dtype": s.dtype, "units": s.units, "unit_bytes": s.unit_bytes,
                "bytes": self.bytes, "reachable_bytes": self.reachable_bytes, "null_bytes": self.null_bytes,
                "unreachable_bytes": self.unreachable_bytes, "padding_bytes": self.padding_bytes,
                "dead_bytes": self.dead_bytes, "in_budget": self.in_budget, "note": self.note}


@dataclass(frozen=True, slots=True, kw_only=True)
class Reported:
    """What the engine itself tells its operator, beside the truth."""

    capacity_tokens: int | None       # the token figure it logs
    capacity_label: str               # what that figure is called in its log
    memory_gauge_bytes: int | None    # its KV-memory gauge; None where it has none
    gauge_label: str
    lines: tuple[str, ...] = ()       # its log lines, paraphrased with our figures


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineResult:
    engine: str                       # e.g. "sglang 0.5.23"
    variant: str
    model: str
    budget_bytes: int
    buffers: tuple[EngineBuffer, ...]
    token_capacity: int               # tokens the running requests together can hold (≤ requests × max_model_len)
    pool_tokens: int                  # tokens the pools hold; any surplus can only serve a prefix cache
    max_running_requests: int
    concurrency: dict                 # context tokens → requests of that length held at once
    reported: Reported
    figures: dict = field(default_factory=dict)   # the engine's own sizing quantities
    notes: tuple[str, ...] = ()
    assumes: str = ""                 # the entry point / GPU / build whose defaults the figures follow
    refused: str = ""                 # why the engine would refuse this deployment on that GPU; "" if it starts

    def _sum(self, attr: str, in_budget: bool = True) -> int:
        return sum(getattr(b, attr) for b in self.buffers if b.in_budget == in_budget)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the tensors the engine sized from the budget."""
        return self._sum("bytes")

    @property
    def outside_bytes(self) -> int:
        """Bytes it allocates beside the budget (request tables, index maps)."""
        return self._sum("bytes", in_budget=False)

    @property
    def over_budget_bytes(self) -> int:
        return self.allocated_bytes - self.budget_bytes

    @property
    def reachable_bytes(self) -> int:
        return self._sum("reachable_bytes")

    @property
    def dead_bytes(self) -> int:
        return self._sum("dead_bytes")

    @property
    def unreachable_bytes(self) -> int:
        return self._sum("unreachable_bytes")

    def pools(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for b in self.buffers:
            if b.in_budget:
                out[b.pool] = out.get(b.pool, 0) + b.bytes
        return out

    def to_dict(self) -> dict:
        r = self.reported
        return {
            "engine": self.engine, "variant": self.variant, "model": self.model, "budget_bytes": self.budget_bytes,
            "allocated_bytes": self.allocated_bytes, "over_budget_bytes": self.over_budget_bytes,
            "outside_budget_bytes": self.outside_bytes, "reachable_bytes": self.reachable_bytes,
            "dead_bytes": self.dead_bytes, "unreachable_bytes": self.unreachable_bytes,
            "token_capacity": self.token_capacity, "pool_tokens": self.pool_tokens,
            "max_running_requests": self.max_running_requests,
            "concurrency": [{"context_tokens": c, "max_requests": n} for c, n in sorted(self.concurrency.items())],
            "reported": {"capacity_tokens": r.capacity_tokens, "capacity_label": r.capacity_label,
                         "memory_gauge_bytes": r.memory_gauge_bytes, "gauge_label": r.gauge_label,
                         "lines": list(r.lines)},
            "figures": dict(self.figures), "notes": list(self.notes),
            "assumes": self.assumes, "refused": self.refused or None,
            "buffers": [b.to_dict() for b in self.buffers],
        }


_ITEMSIZE = {"uint8": 1, "bfloat16": 2, "float32": 4, "int32": 4, "int64": 8}


# ---- building buffer specs the way engines lay them out -----------------------------------

def paged_buffer(name: str, *, pool: str, role: str, kind: str, layers: tuple[int, ...],
                 fmt: formats.RowFormat, entries: int, pages: int, page_bytes: int | None = None,
                 null_pages: int = 1, group: str = "pages") -> BufferSpec:
    """One page-major KV-like buffer: `pages` units of `entries` rows on each layer.
    `page_bytes` overrides the format's own page size where an engine aligns differently."""
    page = fmt.page_bytes(entries) if page_bytes is None else page_bytes
    n = len(layers)
    return BufferSpec(name=name, pool=pool, group=group, role=role, layer_kind=kind, layers=layers,
                      dtype="uint8", inner_shape=(n, page), unit_bytes=n * page,
                      unit_payload_bytes=n * entries * fmt.payload_bytes, entries_per_unit=entries,
                      entry_bytes=fmt.payload_bytes, null_units=null_pages, units=pages)


def row_buffer(name: str, *, pool: str, role: str, kind: str, layers: tuple[int, ...], dtype: str,
               row_bytes: int, rows: int, null_rows: int, group: str = "rows") -> BufferSpec:
    """One row-major buffer (state rows, table rows): `rows` units of one row on each layer."""
    n = max(len(layers), 1)
    return BufferSpec(name=name, pool=pool, group=group, role=role, layer_kind=kind, layers=layers,
                      dtype=dtype, inner_shape=(n, row_bytes // _ITEMSIZE[dtype]), unit_bytes=n * row_bytes,
                      unit_payload_bytes=n * row_bytes, entries_per_unit=1, entry_bytes=row_bytes,
                      null_units=null_rows, units=rows)


def live_tokens(pool_tokens: int, requests: int, max_model_len: int, page_tokens: int) -> int:
    """Tokens running requests can hold: the pool, but no more than every request at max_model_len."""
    return min(pool_tokens, requests * -(-max_model_len // page_tokens) * page_tokens)


def split_options(engine: str, supported: dict, given: dict) -> dict:
    """Engine options with defaults filled; an unknown one is a ConfigError naming the choices."""
    unknown = sorted(set(given) - set(supported))
    if unknown:
        choices = ", ".join(sorted(supported)) or "none"
        raise ConfigError(unknown[0], f"is not an option of the {engine} model",
                          f"use one of: {choices}")
    return {**supported, **given}


def unsupported(field_name: str, engine: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(field_name, f"{engine}: {problem}", fix)
