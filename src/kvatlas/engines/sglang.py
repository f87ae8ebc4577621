"""SGLang 0.5.23's DeepSeek-V4 KV sizing, re-derived (no SGLang code): the pool configurator
that turns a budget into pool sizes, and the pool constructor that turns sizes into tensors.

Two stages, because they disagree: the configurator prices a full token at its page-padded
compressed bytes (plus, in ratio mode, 0.1 of an SWA slot) and solves `budget = fixed +
full × coeff`; the constructor then adds reserves the price never charged (one SWA page per
layer, 256 slots in every compressed pool, state rows rounded up), so the tensors overshoot.

SWA sizing mode. The release's comment says an unset `--swa-full-tokens-ratio` means "cap" mode,
and SPEC §6 repeats it, but the DeepSeek-V4 model override writes 0.1 into the ratio *before*
the server decides whether the user set it, so V4/V4-Pro always run ratio mode 0.1 (and log it as
"explicit"). `swa_mode="auto"` follows the code; `"cap"` shows what the comment intends.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..planning import formats
from ..planning.model import LayerKind, ModelSpec
from ..planning.options import ServeOptions
from ..units import cdiv, round_up
from .base import (CURVE_CONTEXTS, TABLE_CONTEXTS, EngineBuffer, EngineResult, Reported, live_tokens,
                   paged_buffer, row_buffer, split_options, unsupported)

ENGINE = "sglang 0.5.23"
DEFAULT_SWA_RATIO = 0.1         # what the V4 model override sets
# name → default; see `docs/engines.md` for what each does
OPTIONS = {"swa_mode": "auto", "swa_ratio": None, "radix_cache": True, "prefix_tails": None,
           "eviction_interval": 128, "spec_steps": None, "platform": "cuda"}
SWA_MODES = ("auto", "ratio", "cap")


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    """SGLang's knobs for one deployment, after its own defaults are applied."""

    page: int
    requests: int                # max_running_requests per worker
    chunk: int                   # chunked_prefill_size
    window: int
    eviction_interval: int
    draft_tokens: int            # 0: no speculative decoding
    spec_steps: int
    mode: str                    # "ratio" or "cap", after the override is applied
    swa_ratio: float
    prefix_tails: int
    state_bytes: int
    indexer: formats.RowFormat   # what the indexer pool allocates
    indexer_price: formats.RowFormat  # what the configurator prices it at
    context_len: int

    @property
    def spec(self) -> bool:
        return self.draft_tokens > 0

    @property
    def slots(self) -> int:
        return self.requests + 1  # the request table's row 0 is padding

    @property
    def per_request_swa_tokens(self) -> int:
        """SWA slots a running request holds: window, eviction lag, page pad, one step's allocation."""
        draft = self.draft_tokens or 1
        decode_alloc = 2 * max(self.spec_steps, self.draft_tokens) if self.spec else self.page
        return self.window + self.eviction_interval * draft + self.page + decode_alloc


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizing:
    """The configurator's output, with the intermediate prices it logs."""

    bytes_per_swa_token: float
    bytes_per_full_token: float   # compressed KV + indexer, page-padded, before spec inflation
    coeff: float                  # what one full token is charged, all inclusive
    swa_cap_tokens: int | None
    c128_state_fixed: int
    swa_fixed: float
    full_tokens: int
    swa_tokens: int
    c4_state_size: int
    c128_state_size: int


def setup_for(model: ModelSpec, opts: ServeOptions, eng: dict) -> Setup:
    _check(model, opts, eng)
    mode, ratio = _resolve_mode(eng)
    tails = eng["prefix_tails"]
    if tails is None:
        tails = 4 * opts.max_running_requests if eng["radix_cache"] else 0
    indexer = formats.indexer_format(opts.indexer)
    # On CUDA the configurator prices the indexer at fp8 even when the fp4 indexer is on;
    # only the HIP build passes the fp4 flag to its price.
    price = indexer if eng["platform"] == "hip" else formats.indexer_format("fp8")
    steps = eng["spec_steps"] if eng["spec_steps"] is not None else max(opts.draft_tokens - 1, 1)
    return Setup(page=opts.page_tokens, requests=opts.max_running_requests, chunk=opts.chunked_prefill_tokens,
                 window=model.sliding_window, eviction_interval=eng["eviction_interval"],
                 draft_tokens=opts.draft_tokens, spec_steps=steps, mode=mode, swa_ratio=ratio, prefix_tails=tails,
                 state_bytes=formats.state_itemsize(opts.state_dtype), indexer=indexer, indexer_price=price,
                 context_len=opts.max_model_len)


def _resolve_mode(eng: dict) -> tuple[str, float]:
    mode, ratio = eng["swa_mode"], eng["swa_ratio"]
    if mode not in SWA_MODES:
        raise unsupported("swa_mode", ENGINE, f"{mode!r} is not a sizing mode", f"use one of {', '.join(SWA_MODES)}")
    if ratio is not None and not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
        raise unsupported("swa_ratio", ENGINE, f"{ratio!r} is not in (0, 1]", "use e.g. 0.1")
    if mode == "cap":
        if ratio is not None:
            raise unsupported("swa_ratio", ENGINE, "cap mode is used only when no SWA ratio is set",
                              "drop swa_ratio, or use swa_mode ratio")
        return "cap", 0.0
    # auto: the model override sets 0.1 before the explicit-ratio check, so ratio mode wins
    return "ratio", DEFAULT_SWA_RATIO if ratio is None else float(ratio)


def _check(model: ModelSpec, opts: ServeOptions, eng: dict) -> None:
    if model.family != "v4":
        raise unsupported("model", ENGINE, f"{model.name} is a {model.family} model; only V4/V4-Pro are modelled",
                          "compare a deepseek-v4-flash or deepseek-v4-pro preset")
    if opts.kv_layout != "v4":
        raise unsupported("kv_layout", ENGINE, f"only the default fp8_ds_mla layout (v4) is modelled, not {opts.kv_layout!r}",
                          "drop kv_layout")
    if opts.indexer not in ("fp8", "fp4"):
        raise unsupported("indexer", ENGINE, f"has no {opts.indexer} indexer", "use fp8 (default) or fp4")
    if opts.online_c128:
        raise unsupported("online_c128", ENGINE, "its online C128 state is not modelled", "drop online_c128")
    if opts.state_dtype not in ("fp32", "bf16"):
        raise unsupported("state_dtype", ENGINE, f"keeps compressor state in fp32 or bf16, not {opts.state_dtype}",
                          "use state_dtype='fp32' (default) or 'bf16'")
    if opts.page_tokens != 256:
        raise unsupported("page_tokens", ENGINE, "requires page 256 on CUDA", "use page_tokens=256")
    if opts.pp != 1 or opts.dp != 1:
        raise unsupported("pp" if opts.pp != 1 else "dp", ENGINE, "only one rank without pp or attention-DP is modelled",
                          "use pp=1 and dp=1")
    ring = formats.c4_attention_ring(model.head_dim, spec=True)
    if opts.draft_tokens > ring.write_pad:
        raise unsupported("draft_tokens", ENGINE, f"its {ring.rows}-row C4 ring absorbs at most {ring.write_pad} draft tokens",
                          f"use draft_tokens ≤ {ring.write_pad}")
    if eng["platform"] not in ("cuda", "hip"):
        raise unsupported("platform", ENGINE, f"{eng['platform']!r} is not modelled", "use cuda or hip")


def _counts(model: ModelSpec) -> tuple[int, int, int]:
    main = model.layers()
    return (len(main), sum(l.kind is LayerKind.C4 for l in main), sum(l.kind is LayerKind.C128 for l in main))


def _c4_state_row_bytes(model: ModelSpec, s: Setup) -> int:
    """Bytes one C4 layer's attention and indexer state rows take together."""
    att = formats.c4_attention_ring(model.head_dim, s.spec)
    idx = formats.c4_indexer_ring(model.index_head_dim, s.spec)
    return (att.width + idx.width) * s.state_bytes


def configure(model: ModelSpec, s: Setup, budget: int) -> Sizing:
    """Pool sizes from the budget, the way the configurator solves budget = fixed + full × coeff."""
    n_layers, n_c4, n_c128 = _counts(model)
    kv = formats.FP8_DS_MLA
    per_entry = {r: kv.page_bytes(s.page // r) / (s.page // r) for r in (1, 4, 128)}  # page-padded
    ring4 = formats.c4_attention_ring(model.head_dim, s.spec).rows
    swa_tok = per_entry[1] * n_layers + ring4 / s.page * _c4_state_row_bytes(model, s) * n_c4
    full_tok = n_c4 * (per_entry[4] + s.indexer_price.entry_bytes) / 4 + n_c128 * per_entry[128] / 128
    coeff = full_tok + (s.swa_ratio * swa_tok if s.mode == "ratio" else 0.0)
    if s.spec:  # one draft layer is paid for by inflating every price by (L + 1) / L
        infl = (n_layers + 1) / n_layers
        coeff, swa_tok = coeff * infl, swa_tok * infl
    c128 = formats.c128_ring(model.head_dim, s.spec, online=False)
    c128_rows = round_up(s.slots * c128.rows + c128.rows + 1, 128)
    c128_fixed = c128_rows * c128.width * s.state_bytes * n_c128
    cap = None
    if s.mode == "cap":
        in_flight = s.per_request_swa_tokens * s.requests + 2 * s.chunk + s.page  # two chunks with overlap
        cap = round_up(in_flight + s.prefix_tails * (s.window + s.page), s.page)
    swa_fixed = cap * swa_tok if cap is not None else 0.0
    avail = max(budget - c128_fixed - swa_fixed, 0)
    full = int(avail / coeff) // s.page * s.page
    swa = cap if cap is not None else int(full * s.swa_ratio) // s.page * s.page
    _validate(s, budget, full, swa)
    return Sizing(bytes_per_swa_token=swa_tok, bytes_per_full_token=full_tok, coeff=coeff, swa_cap_tokens=cap,
                  c128_state_fixed=c128_fixed, swa_fixed=swa_fixed, full_tokens=full, swa_tokens=swa,
                  c4_state_size=swa // s.page * ring4, c128_state_size=s.slots * c128.rows)


def _validate(s: Setup, budget: int, full: int, swa: int) -> None:
    from ..errors import BudgetError
    if full <= 0:
        raise BudgetError(f"memory: {ENGINE} finds no room for full tokens in {budget} B after its fixed state; "
                          "raise memory or lower max_running_requests")
    if s.mode == "ratio" and swa <= s.window + s.page:
        raise BudgetError(f"memory: {ENGINE} ratio mode gives {swa} SWA slots, not above window + page "
                          f"({s.window + s.page}), so it refuses to start; raise memory or the SWA ratio")


def pools(model: ModelSpec, s: Setup, z: Sizing) -> list[EngineBuffer]:
    """The tensors the pool constructor allocates, with page 0 and sentinel rows as null units
    and the reserve pages no compressed slot index can reach marked unreachable."""
    main = model.layers()
    ids = {k: tuple(l.index for l in main if l.kind is k) for k in (LayerKind.C4, LayerKind.C128)}
    kv, full_pages = formats.FP8_DS_MLA, z.full_tokens // s.page
    swa_pages = cdiv(z.swa_tokens + s.page, s.page)
    out = [EngineBuffer(spec=paged_buffer("swa_kv", pool="swa_kv", role="kv", kind="swa",
                                          layers=tuple(l.index for l in main), fmt=kv, entries=s.page,
                                          pages=swa_pages))]
    if s.spec:  # the MTP draft worker's own SWA pool, same size, one layer
        out.append(EngineBuffer(spec=paged_buffer("draft_swa_kv", pool="draft_swa_kv", role="kv", kind="swa",
                                                  layers=(len(main),), fmt=kv, entries=s.page, pages=swa_pages)))
    for kind, fmt, name in ((LayerKind.C4, kv, "c4_kv"), (LayerKind.C128, kv, "c128_kv"),
                            (LayerKind.C4, s.indexer, "c4_indexer")):
        r = kind.ratio
        entries = s.page // r
        # every compressed pool is sized for its slots plus 256 reserve slots
        pages = cdiv(z.full_tokens // r + s.page, entries)
        spec = paged_buffer(name, pool=name, role="indexer" if "indexer" in name else "kv", kind=kind.value,
                            layers=ids[kind], fmt=fmt, entries=entries, pages=pages)
        out.append(EngineBuffer(spec=spec, unreachable_units=pages - 1 - full_pages,
                                note="slot = full_loc // ratio reaches pages 1..full/page only"))
    out += _state_pools(model, s, z, ids)
    out += _outside(s, z)
    return out


def _state_pools(model: ModelSpec, s: Setup, z: Sizing, ids: dict) -> list[EngineBuffer]:
    dtype = "float32" if s.state_bytes == 4 else "bfloat16"
    out = []
    # C4 state is addressed per SWA page (pages 1..swa/page reach rows ring..size+ring-1); C128
    # state per request slot, and its size already counts slot 0, whose ring only takes dummy writes
    c128 = formats.c128_ring(model.head_dim, s.spec, online=False)
    rings = [(formats.c4_attention_ring(model.head_dim, s.spec), LayerKind.C4, z.c4_state_size, z.c4_state_size, 4),
             (formats.c4_indexer_ring(model.index_head_dim, s.spec), LayerKind.C4, z.c4_state_size,
              z.c4_state_size, 4),
             (c128, LayerKind.C128, z.c128_state_size, z.c128_state_size - c128.rows, 128)]
    for ring, kind, size, reachable, align in rings:
        rows = round_up(size + ring.rows + 1, align)
        null = ring.rows + 1  # the ring of page/slot 0 (dummy writes) and the trailing "empty" sentinel row
        spec = row_buffer(ring.name, pool=ring.name, role="state", kind=kind.value, layers=ids[kind], dtype=dtype,
                          row_bytes=ring.width * s.state_bytes, rows=rows, null_rows=null)
        out.append(EngineBuffer(spec=spec, unreachable_units=rows - reachable - null,
                                note="rows past the last page's/slot's ring, before the sentinel"))
    return out


def _outside(s: Setup, z: Sizing) -> list[EngineBuffer]:
    """Allocated after the budget was profiled, so they come on top of it."""
    def table(name, pool, dtype, row_bytes, rows, null_rows=0, note=""):
        spec = row_buffer(name, pool=pool, role="table", kind="all", layers=(), dtype=dtype, row_bytes=row_bytes,
                          rows=rows, null_rows=null_rows)
        return EngineBuffer(spec=spec, in_budget=False, note=note)
    width = s.context_len + 4 + s.draft_tokens
    return [table("full_to_swa_index", "index_maps", "int64", 8, z.full_tokens + s.page + 1),
            table("req_to_token", "req_to_token", "int32", 4 * width, s.slots, null_rows=1),
            # each paged allocator starts with every page id but page 0 on its free list
            table("free_full_pages", "free_lists", "int64", 8, z.full_tokens // s.page,
                  note="the full allocator's free list: one id per page"),
            table("free_swa_pages", "free_lists", "int64", 8, z.swa_tokens // s.page,
                  note="the SWA allocator's free list: one id per page"),
            table("req_generation", "req_to_token", "int64", 8, s.slots,
                  note="the request table's reuse counter, one per slot; created without a device (host memory)")]


def concurrency(s: Setup, z: Sizing, context_tokens: int) -> int:
    """Requests of `context_tokens` held at once: full pages per request, SWA pages per request,
    and max running requests (capped at full/2 by the server), whichever binds first."""
    if context_tokens > s.context_len:
        return 0
    by_full = (z.full_tokens // s.page) // cdiv(context_tokens, s.page)
    by_swa = (z.swa_tokens // s.page) // cdiv(s.per_request_swa_tokens, s.page)
    return min(s.requests, z.full_tokens // 2, by_full, by_swa)


def run(model: ModelSpec, opts: ServeOptions, budget: int, **engine_options) -> EngineResult:
    eng = split_options(ENGINE, OPTIONS, engine_options)
    s = setup_for(model, opts, eng)
    z = configure(model, s, budget)
    bufs = tuple(pools(model, s, z))
    mode = "cap" if s.mode == "cap" else f"ratio {s.swa_ratio:g}"
    default = eng["swa_mode"] == "auto" and eng["swa_ratio"] is None
    variant = f"{mode}{' (default)' if default else ''}" + _variant_suffix(opts)
    reported = Reported(
        capacity_tokens=z.full_tokens, capacity_label="max_total_num_tokens", memory_gauge_bytes=0,
        gauge_label="sglang:kv_cache_memory_usage_gb (DSV4 pools never set mem_usage)",
        lines=(f"SWA sizing: mode={s.mode}{' (logged as explicit)' if s.mode == 'ratio' else ''}, "
               f"swa_tokens={z.swa_tokens:,}",
               f"bytes_per_full_token={z.coeff:,.2f}, c128_state_fixed={z.c128_state_fixed / 2**30:.2f} GiB, "
               f"full_token={z.full_tokens:,}",
               "no 'KV Cache is allocated' line: the DSV4 pools skip it; the KV memory gauge reads 0"))
    figures = {"mode": s.mode, "swa_ratio": s.swa_ratio, "bytes_per_swa_token": z.bytes_per_swa_token,
               "bytes_per_full_token": z.bytes_per_full_token, "coeff": z.coeff, "swa_cap_tokens": z.swa_cap_tokens,
               "c128_state_fixed_bytes": z.c128_state_fixed, "swa_fixed_bytes": z.swa_fixed,
               "full_tokens": z.full_tokens, "swa_tokens": z.swa_tokens, "c4_state_pool_size": z.c4_state_size,
               "c128_state_pool_size": z.c128_state_size, "per_request_swa_tokens": s.per_request_swa_tokens,
               "prefix_tails": s.prefix_tails}
    contexts = sorted(set(TABLE_CONTEXTS + CURVE_CONTEXTS))
    running = min(s.requests, z.full_tokens // 2)  # the server lowers max running to full/2 at most
    return EngineResult(engine=ENGINE, variant=variant, model=model.name, budget_bytes=budget, buffers=bufs,
                        token_capacity=live_tokens(z.full_tokens, running, s.context_len, s.page),
                        pool_tokens=z.full_tokens, max_running_requests=running,
                        concurrency={c: concurrency(s, z, c) for c in contexts}, reported=reported,
                        figures=figures, notes=_notes(s), assumes=f"its {eng['platform'].upper()} build")


def _variant_suffix(opts: ServeOptions) -> str:
    parts = []
    if opts.draft_tokens:
        parts.append(f"spec {opts.draft_tokens} draft")
    if opts.indexer == "fp4":
        parts.append("fp4 indexer")
    if opts.state_dtype == "bf16":
        parts.append("bf16 state")
    return ", " + ", ".join(parts) if parts else ""


def _notes(s: Setup) -> tuple[str, ...]:
    notes = []
    if s.mode == "cap":
        notes.append("cap mode: what the release's comment intends; 0.5.23 reaches it for V4 only if the "
                     "model override did not set the ratio first, which it always does")
    if s.indexer.entry_bytes != s.indexer_price.entry_bytes:
        notes.append(f"indexer priced at {s.indexer_price.entry_bytes} B/entry but allocated at "
                     f"{s.indexer.entry_bytes}: the difference stays unallocated")
    if s.spec:
        notes.append("spec: every price inflated by (L+1)/L for one draft layer, which only has SWA")
    return tuple(notes)
