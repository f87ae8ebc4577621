"""The planner: a model, options and a budget in; pool sizes, a buffer map and capacity out.

Cost structure (SPEC §3): every running request has a fixed cost (SWA pages or window rows
covering the window plus what one step writes, compressor-state rings, a block-table row); every
cached token costs its compressed KV and indexer entries at their page-padded price; once per rank
there is the null unit of each index space and the in-flight SWA of one prefill chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import buffers as bufmod
from . import formats
from .buffers import CHECKPOINTS, FULL_PAGES, REQUEST_SLOTS, SWA_PAGES, WORKSPACE, BufferSpec
from ..checks import of_type, whole
from ..errors import ConfigError, NotFoundError
from .diagnose import budget_error
from .model import LayerSpec, ModelSpec, load_model
from .options import ServeOptions
from .stages import rank_layers  # noqa: F401 (the planner's; imported from here by callers)
from ..units import cdiv, fmt_bytes

PLAN_SCHEMA_VERSION = 1
CONTEXTS = (4096, 32768, 131072, 1048576)


def swa_pages_per_step(window: int, new_tokens: int, page: int) -> int:
    """Most pages a step's SWA span can overlap, for any start: writing positions [L, L + n)
    reads keys [L − window + 1, L + n), window − 1 + n tokens."""
    span = window - 1 + new_tokens
    return (span - 2) // page + 2 if span >= 2 else 1


def chunk_extra_swa_pages(window: int, decode_tokens: int, page: int, chunk: int, requests: int) -> int:
    """Worst-case SWA pages a prefill chunk of `chunk` tokens, spread over up to `requests`
    requests, needs beyond every request's decode-step pages. The first extra page of a request
    costs `first` chunk tokens, each further one a whole page, so spreading minimal pieces is
    the worst case."""
    base = swa_pages_per_step(window, decode_tokens, page)
    first = max(1, (base - 1) * page - window + 3)  # smallest n with swa_pages_per_step(window, n) > base
    pieces = min(requests, chunk // first)
    return pieces + (chunk - pieces * first) // page


def _pow2(n: int) -> int:
    """Ring sizes are powers of two so that `position % ring` is a mask in the allocator."""
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizing:
    """What the options fix before the budget is spent: units per index space except full pages."""

    requests: int
    swa_pages_per_request: int
    swa_extra_pages: int
    window_rows: int
    workspace_rows: int
    pages_per_request: int
    swa_ring_pages: int     # SWA block-table entries per request: ≥ the most pages one request holds
    checkpoint_units: int = 0   # prefix resume points: kept ones + one being saved per request + a chunk's
    checkpoint_swa_pages: int = 0   # SWA pages one resume point holds (window - 1 tokens before it)


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    model: ModelSpec
    options: ServeOptions
    layers: tuple[LayerSpec, ...]
    budget_bytes: int
    buffers: tuple[BufferSpec, ...]
    units: dict = field(hash=False)
    sizing: Sizing
    bytes_per_token: float
    row_bytes_per_token: float
    bytes_per_request: int
    shared_bytes: int
    checkpoint_bytes: int = 0   # the prefix cache's resume points (not in shared_bytes)
    schema_version: int = PLAN_SCHEMA_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers)

    @property
    def num_full_pages(self) -> int:
        return self.units[FULL_PAGES]

    @property
    def num_swa_pages(self) -> int:
        return self.units[SWA_PAGES]

    @property
    def num_request_slots(self) -> int:
        return self.units[REQUEST_SLOTS]

    @property
    def max_running_requests(self) -> int:
        return self.sizing.requests

    @property
    def page_tokens(self) -> int:
        return self.options.page_tokens

    @property
    def has_compressed(self) -> bool:
        return any(b.group == FULL_PAGES for b in self.buffers)

    @property
    def max_total_tokens(self) -> int:
        """Tokens all live requests together can hold: the full-token pages less the null page,
        or, with no compressed layer on this rank, every request at max_model_len."""
        if self.has_compressed:
            return (self.num_full_pages - 1) * self.page_tokens
        return self.sizing.requests * self.options.max_model_len

    @property
    def unused_bytes(self) -> int:
        return self.budget_bytes - self.total_bytes

    @property
    def dead_bytes(self) -> int:
        return sum(b.dead_bytes for b in self.buffers)

    def buffer(self, name: str) -> BufferSpec:
        for b in self.buffers:
            if b.name == name:
                return b
        raise NotFoundError("name", f"no buffer {name!r} in this plan", f"use one of {', '.join(b.name for b in self.buffers)}")

    def pools(self) -> dict[str, list[BufferSpec]]:
        out: dict[str, list[BufferSpec]] = {}
        for b in self.buffers:
            out.setdefault(b.pool, []).append(b)
        return out

    def concurrency_in_plan(self, context_tokens: int) -> int:
        """Requests of this context the plan's pools hold at once (capped by max running)."""
        if context_tokens > self.options.max_model_len:
            return 0
        if not self.has_compressed:
            return self.sizing.requests
        return min(self.sizing.requests, (self.num_full_pages - 1) // cdiv(context_tokens, self.page_tokens))


def check_plan(p, field: str = "plan") -> Plan:
    return of_type(field, p, Plan, "a Plan", "give what kvatlas.plan() or kvatlas.budget_for() returns")


def checkpoint_units(opts: ServeOptions, requests: int) -> int:
    """Resume points (null excluded): the kept ones, one being saved per running request (its next
    boundary) and the boundaries one prefill chunk can cross, each needing its own."""
    if not opts.prefix_checkpoints:
        return 0
    return opts.prefix_checkpoints + requests + opts.chunked_prefill_tokens // opts.page_tokens + 1


def _sizing(model: ModelSpec, opts: ServeOptions, requests: int) -> Sizing:
    lay = formats.layout(opts.kv_layout)
    page, window = opts.swa_page_tokens, model.sliding_window
    decode = 1 + opts.draft_tokens
    chunk = opts.chunked_prefill_tokens
    ckpts = checkpoint_units(opts, requests)
    if lay.window_rows:
        return Sizing(requests=requests, swa_pages_per_request=0, swa_extra_pages=0,
                      window_rows=window + decode - 1, workspace_rows=chunk,
                      pages_per_request=cdiv(opts.max_model_len, opts.page_tokens), swa_ring_pages=0,
                      checkpoint_units=ckpts)
    tail = cdiv(window - 1, page) if ckpts else 0   # page | page_tokens: the tail ends on a page
    return Sizing(requests=requests, swa_pages_per_request=swa_pages_per_step(window, decode, page),
                  swa_extra_pages=chunk_extra_swa_pages(window, decode, page, chunk, requests) + ckpts * tail,
                  window_rows=0, workspace_rows=0, pages_per_request=cdiv(opts.max_model_len, opts.page_tokens),
                  swa_ring_pages=_pow2(swa_pages_per_step(window, max(chunk, decode), page)),
                  checkpoint_units=ckpts, checkpoint_swa_pages=tail)


class _Sizer:
    """Turns (requests, full pages) into a buffer map; shared by plan(), the inverse and capacity."""

    def __init__(self, model: ModelSpec, opts: ServeOptions) -> None:
        self.model, self.opts = model, opts
        self.layers = rank_layers(model, opts)
        probe = _sizing(model, opts, 1)
        self.tmpls = bufmod.templates(model, opts, self.layers, probe)
        self.page_price = sum(t.unit_bytes for t in self.tmpls if t.group == FULL_PAGES)

    def units(self, requests: int, full_pages: int) -> tuple[Sizing, dict]:
        s = _sizing(self.model, self.opts, requests)
        swa = requests * s.swa_pages_per_request + s.swa_extra_pages + 1
        units = {REQUEST_SLOTS: requests + 1, SWA_PAGES: swa, FULL_PAGES: full_pages + 1 if self.page_price else 0,
                 WORKSPACE: 1, CHECKPOINTS: s.checkpoint_units + 1 if s.checkpoint_units else 0}
        return s, units

    def total(self, requests: int, full_pages: int) -> int:
        _, units = self.units(requests, full_pages)
        return bufmod.slab_bytes(self.tmpls, units)

    def max_pages(self, requests: int, budget: int) -> int:
        """Most full pages (null excluded) that fit beside `requests` requests, or -1."""
        if self.total(requests, 0) > budget:
            return -1
        if not self.page_price:
            return 0
        n = max((budget - self.total(requests, 0)) // self.page_price, 0)
        while n > 0 and self.total(requests, n) > budget:
            n -= 1
        while self.total(requests, n + 1) <= budget:
            n += 1
        return n

    def max_requests(self, budget: int, context_tokens: int) -> int:
        """Most requests of `context_tokens` each that any plan in `budget` holds."""
        need = cdiv(context_tokens, self.opts.page_tokens) if self.page_price else 0
        lo, hi = 0, 1
        while self.max_pages(hi, budget) >= hi * need:
            lo, hi = hi, hi * 2
            if hi > 1 << 24:
                return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.max_pages(mid, budget) >= mid * need:
                lo = mid
            else:
                hi = mid
        return lo


def _build(sizer: _Sizer, budget: int, requests: int, full_pages: int) -> Plan:
    sizing, units = sizer.units(requests, full_pages)
    bufs = bufmod.materialise(sizer.tmpls, units)
    per_request = sum(b.unit_bytes for b in bufs if b.group == REQUEST_SLOTS)
    per_request += sum(b.unit_bytes for b in bufs if b.group == SWA_PAGES) * sizing.swa_pages_per_request
    total = sum(b.bytes for b in bufs)
    checkpoints = sizing.checkpoint_units * checkpoint_unit_bytes(bufs, sizing)
    lay = formats.layout(sizer.opts.kv_layout)
    row_price = formats.per_token_row_bytes(_RankModel(sizer.layers), lay.compressed,
                                            formats.indexer_format(sizer.opts.indexer))
    return Plan(model=sizer.model, options=sizer.opts, layers=sizer.layers, budget_bytes=budget, buffers=bufs,
                units=units, sizing=sizing, bytes_per_token=sizer.page_price / sizer.opts.page_tokens,
                row_bytes_per_token=row_price, bytes_per_request=per_request,
                shared_bytes=total - per_request * requests - full_pages * sizer.page_price - checkpoints,
                checkpoint_bytes=checkpoints)


def checkpoint_unit_bytes(bufs, sizing: Sizing) -> int:
    """Bytes of one resume point: a unit of every checkpoint buffer and its SWA tail pages."""
    unit = sum(b.unit_bytes for b in bufs if b.group == CHECKPOINTS)
    return unit + sizing.checkpoint_swa_pages * sum(b.unit_bytes for b in bufs if b.group == SWA_PAGES)


@dataclass(frozen=True, slots=True)
class _RankModel:
    """Just the layers of one rank, for per-token arithmetic."""

    _layers: tuple[LayerSpec, ...]

    def layers(self, *, draft: bool = False):
        return self._layers


def _resolve(model, options) -> tuple[ModelSpec, ServeOptions]:
    if not isinstance(model, ModelSpec):   # a name or a path; anything else is refused there
        model = load_model(model)
    opts = options if isinstance(options, ServeOptions) else ServeOptions.from_kwargs(**options)
    return model, opts.validated().resolve(model)


def plan(model: ModelSpec | str, memory_bytes: int | str | None = None, **options) -> Plan:
    """Size every pool for `memory_bytes` per rank: max_running_requests request slots, then as
    many full-token pages as fit, never more than the requests could ever address."""
    if memory_bytes is not None:
        options["memory_bytes"] = memory_bytes
    model, opts = _resolve(model, options)
    budget = opts.budget_bytes()
    sizer = _Sizer(model, opts)
    requests = opts.running_requests_per_rank
    one_request = cdiv(opts.max_model_len, opts.page_tokens) if sizer.page_price else 0
    pages = sizer.max_pages(requests, budget)
    if pages < one_request:
        raise budget_error(model, opts, budget, sizer.total(requests, one_request), _Sizer)
    reachable = requests * one_request if sizer.page_price else 0
    return _build(sizer, budget, requests, min(pages, reachable))


def budget_for(model: ModelSpec | str, num_requests: int, context_tokens: int, **options) -> Plan:
    """The inverse: the smallest plan that holds `num_requests` requests of `context_tokens` each."""
    whole("num_requests", num_requests, 1)
    whole("context_tokens", context_tokens, 1)
    return budget_for_mix(model, [(num_requests, context_tokens)], **options)


def budget_for_mix(model: ModelSpec | str, mix, **options) -> Plan:
    """The smallest plan that holds every (requests, context tokens) pair of `mix` at once: as
    many request slots as requests in all, max_model_len the longest context (unless given), and
    exactly the full pages those requests fill."""
    mix = list(mix) if isinstance(mix, (list, tuple)) else mix
    if not isinstance(mix, list) or not mix:
        raise ConfigError("mix", f"{mix!r} is not a list of (requests, context tokens)", "give e.g. [(8, 131072)]")
    for item in mix:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ConfigError("mix", f"{item!r} is not a (requests, context tokens) pair", "give e.g. (8, 131072)")
        whole("num_requests", item[0], 1)
        whole("context_tokens", item[1], 1)
    options.setdefault("max_running_requests", sum(n for n, _ in mix))
    options.setdefault("max_model_len", max(ctx for _, ctx in mix))
    model, opts = _resolve(model, options)
    longest = max(ctx for _, ctx in mix)
    if longest > opts.max_model_len:
        raise ConfigError("context_tokens", f"{longest:,} is above max_model_len={opts.max_model_len:,}",
                          "raise max_model_len or ask for shorter contexts")
    sizer = _Sizer(model, opts)
    requests = opts.running_requests_per_rank
    # dp ranks share the requests: each rank holds its share of every context, rounded up
    pages = sum(cdiv(n, opts.dp) * cdiv(ctx, opts.page_tokens) for n, ctx in mix) if sizer.page_price else 0
    total = sizer.total(requests, pages)
    return _build(sizer, total, requests, pages)


def max_concurrency(p: Plan, context_tokens: int) -> int:
    """Requests of `context_tokens` the same budget holds when max_running_requests is set for it."""
    check_plan(p)
    whole("context_tokens", context_tokens, 1)
    if context_tokens > p.options.max_model_len:
        return 0
    return _Sizer(p.model, p.options).max_requests(p.budget_bytes, context_tokens)
