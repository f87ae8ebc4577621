"""The host tier's buffer map: pinned CPU memory for cached pages and checkpoints, planned from
its own budget (`host_memory_bytes`) the way `planner.py` plans the device pools.

Two index spaces, each unit-major like the device buffers (DESIGN §6: another backing, its own
ledger section):
- host pages: one unit holds one full-token page of every FULL_PAGES buffer (C4 KV, indexer,
  C128 KV, V4.1 r2/r1, unified rope rows), each buffer its own host buffer, so a run of
  consecutive host units is one contiguous range per buffer (one copy per run, not per page);
- host checkpoints: one unit holds what resuming at a page boundary reads (SPEC §8): the SWA
  pages under the last window − 1 tokens (whole pages: 2 × 64 tokens, 1% more than the 127 rows,
  one contiguous range per page), or a V4.1 request window, and the rows of each compressor ring
  that the next block's window reaches back into (C4: 4 rows of attention and indexer state;
  C128 and r2: none at a page boundary).

How the budget splits between the two is `checkpoint_share` (of bytes): pages and checkpoints
come and go in different proportions per workload, so the share is an option; the default 1/3
matches one checkpoint per four 512-token blocks (SPEC §8: 4.05 MB against 4 × 2.0 MB).
Pure Python: no torch. Only multiplies what the device plan and `formats` return.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import buffers as bufmod
from .buffers import CHECKPOINTS, FULL_PAGES, SWA_PAGES, BufferSpec
from .model import LayerKind
from ..errors import BudgetError, ConfigError
from ..units import cdiv, fmt_bytes, parse_bytes

HOST_PAGES, HOST_CHECKPOINTS = "host_pages", "host_checkpoints"
DEFAULT_CHECKPOINT_SHARE = 1 / 3
HOST_PLAN_SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class HostSource:
    """Where one host buffer's bytes come from on the device: `device_units` whole units of
    device buffer `buffer` per host unit, or (`rows` > 0) that many consecutive ring rows of
    every layer of one unit of a state buffer."""

    buffer: str
    device_units: int = 1
    rows: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class HostPlan:
    budget_bytes: int
    checkpoint_share: float
    buffers: tuple[BufferSpec, ...]
    sources: dict
    units: dict
    tail_tokens: int          # SWA tokens a checkpoint must hold (window − 1)
    schema_version: int = HOST_PLAN_SCHEMA_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers)

    @property
    def num_pages(self) -> int:
        return self.units[HOST_PAGES]

    @property
    def num_checkpoints(self) -> int:
        return self.units[HOST_CHECKPOINTS]

    def group_buffers(self, group: str) -> tuple[BufferSpec, ...]:
        return tuple(b for b in self.buffers if b.group == group)

    def unit_bytes(self, group: str) -> int:
        """Bytes one host page or one checkpoint moves (all its buffers)."""
        return sum(b.unit_bytes for b in self.group_buffers(group))

    @property
    def unused_bytes(self) -> int:
        return self.budget_bytes - self.total_bytes

    def to_dict(self) -> dict:
        return {"schema": "kvatlas.host_plan", "schema_version": self.schema_version,
                "budget_bytes": self.budget_bytes, "total_bytes": self.total_bytes,
                "checkpoint_share": self.checkpoint_share, "pages": self.num_pages,
                "checkpoints": self.num_checkpoints, "page_bytes": self.unit_bytes(HOST_PAGES),
                "checkpoint_bytes": self.unit_bytes(HOST_CHECKPOINTS), "tail_tokens": self.tail_tokens,
                "buffers": [{**b.to_dict(), "source": self.sources[b.name].buffer} for b in self.buffers]}


def _host_spec(spec: BufferSpec, name: str, group: str, inner: tuple, unit_bytes: int, payload: int,
               entries: int) -> BufferSpec:
    return replace(spec, name=name, group=group, inner_shape=inner, unit_bytes=unit_bytes,
                   unit_payload_bytes=payload, entries_per_unit=entries, null_units=0, units=0,
                   offset_bytes=0, tail_bytes=0)


def _page_templates(plan) -> list[tuple[BufferSpec, HostSource]]:
    return [(_host_spec(b, b.name, HOST_PAGES, b.inner_shape, b.unit_bytes, b.unit_payload_bytes,
                        b.entries_per_unit), HostSource(buffer=b.name))
            for b in plan.buffers if b.group == FULL_PAGES]


def _checkpoint_templates(plan) -> list[tuple[BufferSpec, HostSource]]:
    """With the prefix cache, a host checkpoint mirrors one device checkpoint: its tail SWA pages
    and one unit of every CHECKPOINTS buffer (saved ring rows, V4.1 window rows). Without it, the
    same content is taken from a running request: the ring rows the next block reads back into
    (`StateRing.resume_rows`), or its whole V4.1 window."""
    out = []
    opts, window = plan.options, plan.model.sliding_window
    tail_pages = plan.sizing.checkpoint_swa_pages or cdiv(window - 1, opts.swa_page_tokens)
    prefix = any(b.group == CHECKPOINTS for b in plan.buffers)
    for b in plan.buffers:
        name = f"checkpoint.{b.name.removeprefix('ckpt.')}"
        if b.group == SWA_PAGES:
            out.append((_host_spec(b, name, HOST_CHECKPOINTS, (tail_pages, *b.inner_shape),
                                   tail_pages * b.unit_bytes, tail_pages * b.unit_payload_bytes,
                                   tail_pages * b.entries_per_unit),
                        HostSource(buffer=b.name, device_units=tail_pages)))
        elif b.group == CHECKPOINTS or (not prefix and b.role == "window"):
            out.append((_host_spec(b, name, HOST_CHECKPOINTS, b.inner_shape, b.unit_bytes,
                                   b.unit_payload_bytes, b.entries_per_unit), HostSource(buffer=b.name)))
        elif b.role == "state" and not prefix:
            kind = LayerKind(b.layer_kind)
            ring = next(r for r in bufmod.state_rings(plan.model, opts, kind) if r.name == b.name)
            if ring.resume_rows:
                n, _, width = b.inner_shape
                size = n * ring.resume_rows * b.entry_bytes
                out.append((_host_spec(b, name, HOST_CHECKPOINTS, (n, ring.resume_rows, width), size, size,
                                       ring.resume_rows), HostSource(buffer=b.name, rows=ring.resume_rows)))
    return out


def _check_share(share) -> float:
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
        raise ConfigError("checkpoint_share", f"{share!r} is not a fraction in [0, 1)",
                          "give the share of host bytes kept for checkpoints, e.g. 0.33 (0: pages only)")
    return float(share)


def plan_host(plan, host_memory_bytes: int | str, checkpoint_share: float = DEFAULT_CHECKPOINT_SHARE) -> HostPlan:
    """Size the host tier of device plan `plan` for `host_memory_bytes` of pinned host memory."""
    from .planner import check_plan
    check_plan(plan)
    budget = parse_bytes(host_memory_bytes, "host_memory_bytes")
    share = _check_share(checkpoint_share)
    pages, ckpts = _page_templates(plan), _checkpoint_templates(plan)
    if not pages:
        raise ConfigError("host_memory_bytes", "this plan has no full-token pages to move to host memory "
                          "(no compressed layer on this rank)", "plan the host tier for a rank that caches compressed KV")
    tmpls = [t for t, _ in pages + ckpts]
    sources = {t.name: s for t, s in pages + ckpts}
    ckpt_unit = sum(t.unit_bytes for t, _ in ckpts)
    page_unit = sum(t.unit_bytes for t, _ in pages)
    n_ckpt = int(budget * share) // ckpt_unit if ckpt_unit and share else 0
    n_page = max((budget - n_ckpt * ckpt_unit) // page_unit, 0)
    while n_page > 0 and bufmod.slab_bytes(tmpls, {HOST_PAGES: n_page, HOST_CHECKPOINTS: n_ckpt}) > budget:
        n_page -= 1
    if n_page < 1 or (share and ckpt_unit and n_ckpt < 1):
        need = bufmod.slab_bytes(tmpls, {HOST_PAGES: 1, HOST_CHECKPOINTS: 1 if share else 0})
        raise BudgetError(f"host_memory_bytes: {fmt_bytes(budget)} ({budget} B) cannot hold one host page "
                          f"({page_unit} B)" + (f" and one checkpoint ({ckpt_unit} B) at checkpoint_share {share:g}"
                                                if share and ckpt_unit else "")
                          + f"; give at least {need} B ({fmt_bytes(need)}) or a checkpoint_share that leaves room")
    units = {HOST_PAGES: n_page, HOST_CHECKPOINTS: n_ckpt}
    return HostPlan(budget_bytes=budget, checkpoint_share=share, buffers=bufmod.materialise(tmpls, units),
                    sources=sources, units=units, tail_tokens=plan.model.sliding_window - 1)
