"""vLLM's hybrid KV cache manager for DeepSeek-V4, re-derived (no vLLM code).

Every cache of every layer becomes a per-layer spec with its own block size (tokens per block)
and page bytes rounded up to a multiple of 576. Layers are bucketed by (kind, block, window),
buckets are split into groups that repeat the same layer pattern, and all groups draw block ids
from one shared pool whose block is as large as the largest group's page. A block lent to a
smaller group wastes the difference. A sliding group (SWA, compressor state) admits a request
only when `cdiv(window - 1 + in-flight tokens, block) + 1` blocks are free, and the figure vLLM
logs as "GPU KV cache size" is max_model_len times blocks / (every group's per-request maximum):
a concurrency, not a capacity.

Its defaults are not one setting: `max_num_batched_tokens` and `max_num_seqs` follow the entry
point (`vllm serve` or the offline `LLM` class) and the GPU's memory, so the model takes both as
options and says which it assumed. Block 0 is the null block, set aside before the start-up check.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..planning import formats
from ..errors import BudgetError
from ..planning.model import LayerKind, ModelSpec
from ..planning.options import GPU_ARCH, GPU_MEMORY_BYTES, ServeOptions
from ..planning.planner import swa_pages_per_step
from ..units import cdiv, round_up
from .base import (CURVE_CONTEXTS, TABLE_CONTEXTS, EngineBuffer, EngineResult, Reported, live_tokens,
                   split_options, unsupported)
from ..planning.buffers import BufferSpec

RELEASES = ("0.34", "0.33")   # newest first: `vllm` in a lineup is the newest, `vllm@0.33` the older
ENGINE = f"vllm {RELEASES[0]}"
OPTIONS = {"async_scheduling": True, "max_num_batched_tokens": None, "entrypoint": "serve", "release": RELEASES[0],
           "activation_peak_bytes": 0}
ENTRYPOINTS = {"serve": "vllm serve", "offline": "the offline LLM class"}
PAGE_ALIGN = formats.FP8_DS_MLA_PAGE_ALIGN   # every V4 spec pads its page to 576 B
SWA_BLOCK_TOKENS = 64                        # the SWA backend's block; compressed KV uses 256


@dataclass(frozen=True, slots=True, kw_only=True)
class Cache:
    """One cache of one layer, as vLLM specs it."""

    name: str
    layer: int
    bucket: str           # mla / swa / c4_state / c128_state
    block_tokens: int
    window: int | None    # None: full attention (grows with the request)
    page_bytes: int
    payload_bytes: int    # of the page, bytes that hold data


@dataclass(frozen=True, slots=True, kw_only=True)
class Group:
    bucket: str
    index: int
    caches: tuple[Cache, ...]

    @property
    def name(self) -> str:
        return f"{self.bucket}.{self.index}" if self.bucket == "swa" else self.bucket

    @property
    def page_bytes(self) -> int:
        return sum(c.page_bytes for c in self.caches)

    @property
    def payload_bytes(self) -> int:
        return sum(c.payload_bytes for c in self.caches)

    @property
    def block_tokens(self) -> int:
        return self.caches[0].block_tokens

    @property
    def window(self) -> int | None:
        return self.caches[0].window


def _kv(name, layer, bucket, block, window, fmt: formats.RowFormat, entries) -> Cache:
    return Cache(name=name, layer=layer, bucket=bucket, block_tokens=block, window=window,
                 page_bytes=round_up(fmt.page_bytes(entries), PAGE_ALIGN), payload_bytes=entries * fmt.payload_bytes)


def _state(name, layer, bucket, block, ring: formats.StateRing) -> Cache:
    row = ring.width * formats.state_itemsize("fp32")  # vLLM keeps compressor state in fp32 only
    return Cache(name=name, layer=layer, bucket=bucket, block_tokens=block, window=ring.window,
                 page_bytes=round_up(block * row, PAGE_ALIGN), payload_bytes=block * row)


def layer_caches(model: ModelSpec, opts: ServeOptions) -> list[Cache]:
    kv, idx, page = formats.FP8_DS_MLA, formats.indexer_format(opts.indexer), opts.page_tokens
    out = []
    for layer in model.layers(draft=bool(opts.draft_layers)):
        i = layer.index
        out.append(_kv("swa", i, "swa", SWA_BLOCK_TOKENS, model.sliding_window, kv, SWA_BLOCK_TOKENS))
        if layer.kind is LayerKind.C4:
            out.append(_kv("c4_kv", i, "mla", page, None, kv, page // 4))
            out.append(_kv("c4_indexer", i, "mla", page, None, idx, page // 4))
            out.append(_state("c4_state", i, "c4_state", 4, formats.c4_attention_ring(model.head_dim, False)))
            out.append(_state("c4_indexer_state", i, "c4_state", 4, formats.c4_indexer_ring(model.index_head_dim, False)))
        elif layer.kind is LayerKind.C128:
            out.append(_kv("c128_kv", i, "mla", page, None, kv, page // 128))
            out.append(_state("c128_state", i, "c128_state", 8, formats.c128_ring(model.head_dim, False, False)))
    return out


def batch_defaults(gpu: str, entrypoint: str) -> tuple[int, int]:
    """vLLM's own (max_num_batched_tokens, max_num_seqs) for an entry point on a GPU, by the
    GPU's total memory: 160 GiB or more, 70 GiB or more (A100s excepted, none modelled), less."""
    memory = GPU_MEMORY_BYTES[gpu]
    if memory >= 160 * 2**30:
        return 16384, 1024
    if memory >= 70 * 2**30:
        return (8192 if entrypoint == "serve" else 16384), 1024
    return (2048 if entrypoint == "serve" else 8192), 256


def approximate_gcd(values: list[int], lower_bound: int) -> int:
    """The repeat count d ≥ lower_bound that pads the layer counts least when each is rounded
    up to a multiple of d; ties go to the larger d."""
    best, best_pad = lower_bound, None
    for d in range(max(lower_bound, 1), max(values) + 1):
        pad = sum((d - x % d) % d for x in values)
        if best_pad is None or pad <= best_pad:
            best, best_pad = d, pad
    return best


def groups(caches: list[Cache]) -> list[Group]:
    """Bucket, then split balanced buckets (equal layer counts per page size) into groups that
    each take every n-th repeat of the layer pattern."""
    buckets: dict[str, dict[int, list[Cache]]] = {}
    for c in caches:
        buckets.setdefault(c.bucket, {}).setdefault(c.page_bytes, []).append(c)
    balanced = {b: len({len(v) for v in by_page.values()}) == 1 for b, by_page in buckets.items()}
    widest = {b: max(len(v) for v in by_page.values()) for b, by_page in buckets.items()}
    floor = max((widest[b] for b in buckets if balanced[b] and len(buckets[b]) > 1), default=0)
    repeats = approximate_gcd([widest[b] for b in buckets if balanced[b]], floor) if floor else None
    out = []
    for b, by_page in buckets.items():
        n = cdiv(widest[b], repeats) if balanced[b] and repeats else 1
        pattern = list(zip(*by_page.values())) if balanced[b] else [tuple(c for v in by_page.values() for c in v)]
        for i in range(n):
            out.append(Group(bucket=b, index=i, caches=tuple(c for rep in pattern[i::n] for c in rep)))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizing:
    groups: tuple[Group, ...]
    bytes_per_block: int
    num_blocks: int
    max_blocks_per_request: dict    # group → blocks one max_model_len request may need
    prefill_peak_blocks: dict       # sliding group → blocks a request in chunked prefill peaks at
    held_blocks_per_request: dict   # group → blocks a decoding request keeps (sliding groups)
    page_tokens: int
    max_model_len: int
    requests: int
    batched_tokens: int             # max_num_batched_tokens: the prefill tokens of one step
    step_tokens: int                # tokens a decoding request takes from a step (1 + draft tokens)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1  # block 0 is the null block

    @property
    def logged_concurrency(self) -> float:
        return self.num_blocks / sum(self.max_blocks_per_request.values())

    @property
    def logged_tokens(self) -> int:
        return int(self.logged_concurrency * self.max_model_len)

    @property
    def held_total(self) -> int:
        return sum(self.held_blocks_per_request.values())


def configure(model: ModelSpec, opts: ServeOptions, eng: dict, budget: int) -> Sizing:
    gs = tuple(groups(layer_caches(model, opts)))
    bpb = max(g.page_bytes for g in gs)
    batched = eng["max_num_batched_tokens"] or batch_defaults(opts.gpu, eng["entrypoint"])[0]
    in_flight = (2 if eng["async_scheduling"] else 1) * batched
    max_len, step = opts.max_model_len, 1 + opts.draft_tokens
    cap, peak, held = {}, {}, {}
    for g in gs:
        if g.window is None:
            cap[g.name] = cdiv(max_len, g.block_tokens)
        else:
            cap[g.name], peak[g.name], held[g.name] = sliding_blocks_per_request(
                g.window, g.block_tokens, in_flight, max_len, step)
    return Sizing(groups=gs, bytes_per_block=bpb, num_blocks=budget // bpb, max_blocks_per_request=cap,
                  prefill_peak_blocks=peak, held_blocks_per_request=held, page_tokens=opts.page_tokens, max_model_len=max_len,
                  requests=opts.max_running_requests, batched_tokens=batched, step_tokens=step)


def sliding_blocks_per_request(window: int, block: int, in_flight: int, max_len: int, step: int) -> tuple[int, int, int]:
    """One sliding group's blocks per request: (admission reserve, chunked-prefill peak, held while
    decoding), for a window of `window` tokens in blocks of `block` tokens."""
    reserve = cdiv(min(window - 1 + in_flight, max_len), block) + 1
    # the reserve's "+ 1" covers a span starting inside a block; a chunked prefill starts on a
    # chunk boundary, a multiple of every block, so it spans the window's blocks before it and its
    # own in-flight tokens' blocks: one fewer whenever those fill blocks
    peak = min(cdiv(window - 1, block) + cdiv(in_flight, block), cdiv(max_len, block))
    return reserve, peak, swa_pages_per_step(window, step, block)


def _admitted_blocks(z: Sizing, context_tokens: int) -> int:
    """Blocks the last request admitted needs free: its full blocks and, per sliding group, its
    admission reserve (no more than its context spans)."""
    admit = sum(min(cdiv(context_tokens, g.block_tokens), z.max_blocks_per_request[g.name])
                for g in z.groups if g.window is not None)
    return cdiv(context_tokens, z.page_tokens) + admit


def concurrency(z: Sizing, context_tokens: int) -> int:
    """Requests of `context_tokens` held at once. Earlier requests have settled into decode and
    keep only their window's blocks per sliding group; the last one admitted must find its
    admission reserve (capped per group) free."""
    if context_tokens > z.max_model_len:
        return 0
    full = cdiv(context_tokens, z.page_tokens)
    free = z.usable_blocks - _admitted_blocks(z, context_tokens)
    if free < 0:
        return 0
    return min(z.requests, 1 + free // (full + z.held_total))


def concurrency_filling(z: Sizing, context_tokens: int) -> int:
    """Requests of `context_tokens` prompt tokens held when a queue of them is admitted one after
    another into an empty engine: the same rule as `concurrency`, at the lengths the requests
    really have. While one request prefills, max_num_batched_tokens less the decode tokens per
    step, every request already admitted decodes one token a step, so early ones have grown."""
    if context_tokens > z.max_model_len:
        return 0
    done_at: list[int] = []   # the step each admitted request finished its prefill
    step = 0
    while len(done_at) < z.requests:
        held = sum(cdiv(context_tokens + step - t, z.page_tokens) + z.held_total for t in done_at)
        if held + _admitted_blocks(z, context_tokens) > z.usable_blocks:
            break
        per_step = z.batched_tokens - len(done_at) * z.step_tokens
        if per_step <= 0:  # the decodes take every token of a step: no prefill advances
            break
        step += cdiv(context_tokens, per_step)
        done_at.append(step)
    return len(done_at)


def sliding_blocks(z: Sizing) -> dict:
    return serving_sliding_blocks(z.held_blocks_per_request, z.prefill_peak_blocks, z.requests)


def serving_sliding_blocks(held: dict, peak: dict, requests: int) -> dict:
    """Blocks per sliding group while `requests` requests run: all but one decoding (a few
    blocks each) and one in chunked prefill at its peak: the window plus every in-flight token
    (per token for the state groups), one block under the admission reserve."""
    return {name: (requests - 1) * h + peak[name] for name, h in held.items()}


def pool_tokens(z: Sizing) -> int:
    """Tokens the full group holds beside the sliding blocks of a serving batch (block 0 is null)."""
    return max(z.usable_blocks - sum(sliding_blocks(z).values()), 0) * z.page_tokens


def buffers(z: Sizing) -> list[EngineBuffer]:
    """The one backing tensor, split by which group owns each block while max_num_seqs requests
    run (see `sliding_blocks`) and every other block holds full tokens. Units are blocks."""
    def part(name, pool, role, kind, layers, units, payload, null=0):
        spec = BufferSpec(name=name, pool=pool, group="blocks", role=role, layer_kind=kind, layers=layers,
                          dtype="uint8", inner_shape=(z.bytes_per_block,), unit_bytes=z.bytes_per_block,
                          unit_payload_bytes=payload, entries_per_unit=1, entry_bytes=payload,
                          null_units=null, units=units)
        return EngineBuffer(spec=spec, note="aliases the shared block pool")
    out = [part("null_block", "null_block", "null", "all", (), 1, 0, null=1)]
    sliding = sliding_blocks(z)
    for g in z.groups:
        units = sliding[g.name] if g.window is not None else pool_tokens(z) // z.page_tokens
        role = "kv" if g.bucket in ("mla", "swa") else "state"
        layers = tuple(sorted({c.layer for c in g.caches}))
        out.append(part(g.name, g.name, role, g.bucket, layers, units, g.payload_bytes))
    return out


# ---- 0.34's extensible ("elastic") KV cache: sized after warm-up from measured memory ---------------

DEFAULT_GPU_MEMORY_UTILIZATION = 0.92          # without the extensible cache (and 0.33's default)
EXTENSIBLE_GPU_MEMORY_UTILIZATION = 1.0        # 0.34's default with it (gpu_memory_utilization None)
MARGIN_FLOOR_BYTES = 1 << 30                   # CUDA (ROCm: 3 GiB)
MARGIN_FRACTION = 0.75                         # of the transient peak
NON_TORCH_RESERVE_BYTES = 1 << 29              # kept out of torch's cap, not out of the cache (CUDA)
WARMUP_RESERVE_FRACTION = 0.1                  # of the headroom, while warm-up commits blocks
GRANULE_BYTES = 2 << 20                        # VMM commits whole 2 MiB granules per segment


def engine_name(release: str) -> str:
    return f"vllm {release}"


def resolved_gpu_memory_utilization(utilization: float | None, extensible: bool) -> float:
    """0.34's default: None → 1.0 with the extensible cache, 0.92 without (0.33: always 0.92)."""
    if utilization is not None:
        return utilization
    return EXTENSIBLE_GPU_MEMORY_UTILIZATION if extensible else DEFAULT_GPU_MEMORY_UTILIZATION


def extensible_kv_bytes(*, init_free_bytes: int, non_kv_bytes: int, requested_bytes: int,
                        transient_peak_bytes: int = 0, torch_reserve_growth_bytes: int = 0) -> int:
    """The bytes 0.34's extensible cache may commit after warm-up: the budget less what the engine
    uses besides the cache, capped by the device's headroom less a margin of max(1 GiB, 0.75 ×
    the transient peak), less the larger of that peak and torch's reservation growth."""
    headroom = init_free_bytes - non_kv_bytes
    margin = max(MARGIN_FLOOR_BYTES, int(transient_peak_bytes * MARGIN_FRACTION))
    available = min(requested_bytes - non_kv_bytes, headroom - margin)
    return max(available - max(transient_peak_bytes, torch_reserve_growth_bytes), 0)


def fixed_kv_bytes(*, total_bytes: int, non_kv_bytes: int, transient_peak_bytes: int = 0,
                   utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION) -> int:
    """The profiled (fixed) sizing: utilization × the device less what profiling saw besides the
    cache (weights, non-torch memory, CUDA graphs) and the activation peak."""
    import math
    return max(math.ceil(total_bytes * utilization) - non_kv_bytes - transient_peak_bytes, 0)


def extensible_blocks(kv_bytes: int, bytes_per_block: int, capacity_blocks: int) -> int:
    """Blocks whose physical footprint (one segment, granule-rounded) fits in kv_bytes."""
    n = min(kv_bytes // bytes_per_block, capacity_blocks)
    while n > 0 and round_up(n * bytes_per_block, GRANULE_BYTES) > kv_bytes:
        n -= 1
    return n


def sizing_modes(opts: ServeOptions, eng: dict, bytes_per_block: int) -> dict | None:
    """0.34 on a budget made from the GPU (memory × mem_fraction − weights): what each of its
    sizing modes would give the cache with its own default utilization, in bytes and blocks, and
    the flags that hold it to kvatlas's budget instead. None for 0.33 or a budget given in bytes."""
    if eng["release"] != "0.34" or opts.memory_bytes is not None:
        return None
    total, weights, peak = GPU_MEMORY_BYTES[opts.gpu], int(opts.weights_bytes), eng["activation_peak_bytes"]
    reserve = fixed_kv_bytes(total_bytes=total, non_kv_bytes=weights, transient_peak_bytes=peak, utilization=1.0)
    elastic = extensible_kv_bytes(init_free_bytes=total, non_kv_bytes=weights, requested_bytes=total,
                                  transient_peak_bytes=peak)
    fixed = fixed_kv_bytes(total_bytes=total, non_kv_bytes=weights, transient_peak_bytes=peak)
    return {"gpu_total_bytes": total, "weights_bytes": weights, "activation_peak_bytes": peak,
            "extensible": {"gpu_memory_utilization": EXTENSIBLE_GPU_MEMORY_UTILIZATION, "reserved_bytes": reserve,
                           "reserved_blocks": reserve // bytes_per_block, "kv_bytes": elastic,
                           "num_blocks": extensible_blocks(elastic, bytes_per_block, reserve // bytes_per_block),
                           "margin_bytes": max(MARGIN_FLOOR_BYTES, int(peak * MARGIN_FRACTION))},
            "fixed": {"gpu_memory_utilization": DEFAULT_GPU_MEMORY_UTILIZATION, "kv_bytes": fixed,
                      "num_blocks": fixed // bytes_per_block},
            "flags_for_budget": {"--gpu-memory-utilization": opts.mem_fraction}}


def _check(model: ModelSpec, opts: ServeOptions, eng: dict) -> None:
    if eng["release"] not in RELEASES:
        raise unsupported("release", "vllm", f"{eng['release']!r} is not a modelled release",
                          f"use one of {', '.join(RELEASES)} (vllm@0.33 in a lineup)")
    name = engine_name(eng["release"])
    if model.family != "v4":
        raise unsupported("model", name, f"{model.name} is a {model.family} model; only V4/V4-Pro are modelled",
                          "compare a deepseek-v4-flash or deepseek-v4-pro preset")
    if opts.state_dtype != "fp32":
        raise unsupported("state_dtype", name, "keeps compressor state in fp32 only (its state cache asserts it)",
                          f"drop state_dtype={opts.state_dtype!r}, or leave vllm out of the lineup (kvatlas,sglang)")
    if opts.online_c128:
        raise unsupported("online_c128", name, "has no online C128 state", "drop online_c128")
    if opts.kv_layout != "v4":
        raise unsupported("kv_layout", name, f"only the fp8_ds_mla layout (v4) is modelled, not {opts.kv_layout!r}",
                          "drop kv_layout")
    if opts.indexer not in ("fp8", "fp4"):
        raise unsupported("indexer", name, f"has no {opts.indexer} indexer", "use fp8 (default) or fp4 (mxfp4)")
    if opts.page_tokens != 256:
        raise unsupported("page_tokens", name, "the V4 sparse-MLA kernels take block 256 only", "use page_tokens=256")
    if opts.pp != 1 or opts.dp != 1:
        raise unsupported("pp" if opts.pp != 1 else "dp", name, "only one rank without pp or dp is modelled",
                          "use pp=1 and dp=1")
    if eng["entrypoint"] not in ENTRYPOINTS:
        raise unsupported("entrypoint", name, f"{eng['entrypoint']!r} is not an entry point",
                          f"use one of {', '.join(ENTRYPOINTS)}")


def _refuse_without_one_request(z: Sizing, budget: int, name: str = ENGINE) -> None:
    """Its start-up check runs after the null block is set aside: the blocks left must cover
    one max_model_len request, so a pool of exactly that many blocks is refused."""
    need = sum(z.max_blocks_per_request.values())
    if z.usable_blocks < need:
        raise BudgetError(f"memory: {name} refuses to start: one request of max_model_len={z.max_model_len} "
                          f"needs {need:,} blocks besides the null block ({(need + 1) * z.bytes_per_block:,} B) "
                          f"but {budget:,} B hold {z.num_blocks:,}; raise memory or lower max_model_len")


def _setting(opts: ServeOptions, eng: dict, z: Sizing) -> tuple[str, str]:
    """What the figures assume (entry point, GPU, the defaults that follow) and, if the engine
    would refuse this deployment on that GPU, why."""
    default_batched, default_seqs = batch_defaults(opts.gpu, eng["entrypoint"])
    source = "given" if eng["max_num_batched_tokens"] else "its default there"
    assumes = (f"{ENTRYPOINTS[eng['entrypoint']]} on {opts.gpu}: max_num_batched_tokens {z.batched_tokens:,} "
               f"({source}), max_num_seqs {z.requests:,} (given; its default there {default_seqs:,})")
    refused = ""
    if opts.indexer == "fp4" and GPU_ARCH[opts.gpu] != "blackwell":
        refused = f"the fp4 indexer needs a Blackwell GPU; {opts.gpu} is {GPU_ARCH[opts.gpu]}"
    return assumes, refused


def _figures(z: Sizing, opts: ServeOptions, eng: dict, filling: dict) -> dict:
    return {"bytes_per_block": z.bytes_per_block, "num_blocks": z.num_blocks,
            "groups": [{"name": g.name, "layers": len({c.layer for c in g.caches}), "caches": len(g.caches),
                        "block_tokens": g.block_tokens, "page_bytes": g.page_bytes,
                        "max_blocks_per_request": z.max_blocks_per_request[g.name],
                        "prefill_peak_blocks": z.prefill_peak_blocks.get(g.name),
                        "held_blocks_per_request": z.held_blocks_per_request.get(g.name)} for g in z.groups],
            "logged_concurrency": z.logged_concurrency, "logged_tokens": z.logged_tokens,
            "slope_bytes_per_token": z.bytes_per_block / z.page_tokens,
            "gpu": opts.gpu, "entrypoint": eng["entrypoint"], "max_num_batched_tokens": z.batched_tokens,
            "max_num_seqs": z.requests, "default_max_num_seqs": batch_defaults(opts.gpu, eng["entrypoint"])[1],
            "concurrency_filling": filling}


def run(model: ModelSpec, opts: ServeOptions, budget: int, **engine_options) -> EngineResult:
    eng = split_options("vllm", OPTIONS, engine_options)
    _check(model, opts, eng)
    name = engine_name(eng["release"])
    z = configure(model, opts, eng, budget)
    _refuse_without_one_request(z, budget, name)
    assumes, refused = _setting(opts, eng, z)
    modes = sizing_modes(opts, eng, z.bytes_per_block)
    contexts = sorted(set(TABLE_CONTEXTS + CURVE_CONTEXTS))
    reported = Reported(
        capacity_tokens=z.logged_tokens, capacity_label="GPU KV cache size", memory_gauge_bytes=None,
        gauge_label="none in bytes (vllm:kv_cache_usage_perc is a share of blocks)",
        lines=(f"GPU KV cache size: {z.logged_tokens:,} tokens",
               f"Maximum concurrency for {z.max_model_len:,} tokens per request: {z.logged_concurrency:.2f}x"))
    filling = {c: concurrency_filling(z, c) for c in TABLE_CONTEXTS}
    notes = ("'GPU KV cache size' is max concurrency × max_model_len: it moves with max_model_len",
             "each sliding group admits a request only with its reserve free; a decoding request keeps a few blocks",
             "fed same-length prompts from empty it holds " + ", ".join(f"{n:,} @{c:,}" for c, n in filling.items())
             + ": earlier requests decode, and grow, while later ones prefill")
    if eng["release"] == "0.34":
        notes += ((_sizing_note(modes, budget),) if modes else
                  ("0.34 with --kv-cache-memory-bytes (this budget given in bytes) sizes the cache as 0.33 does: "
                   "its extensible cache is off",))
    figures = _figures(z, opts, eng, filling)
    if modes:
        figures["sizing"] = modes
    return EngineResult(engine=name, variant="hybrid manager" + _suffix(opts), model=model.name, budget_bytes=budget,
                        buffers=tuple(buffers(z)), pool_tokens=pool_tokens(z),
                        token_capacity=live_tokens(pool_tokens(z), z.requests, z.max_model_len, z.page_tokens),
                        max_running_requests=opts.max_running_requests,
                        concurrency={c: concurrency(z, c) for c in contexts}, reported=reported,
                        figures=figures, notes=notes, assumes=assumes, refused=refused)


def _sizing_note(m: dict, budget: int) -> str:
    e, f = m["extensible"], m["fixed"]
    return (f"0.34 sizes its cache after warm-up (extensible, on by default on CUDA): with --gpu-memory-utilization "
            f"unset (1.0) it would take {e['kv_bytes']:,} B = {e['num_blocks']:,} blocks (the device less weights, a "
            f"{e['margin_bytes']:,} B margin and the {m['activation_peak_bytes']:,} B activation peak assumed), "
            f"reserving {e['reserved_bytes']:,} B of address space; fixed sizing (--no-enable-extensible-kv-cache, "
            f"0.92) would take {f['kv_bytes']:,} B = {f['num_blocks']:,} blocks; these rows use the budget "
            f"{budget:,} B: --gpu-memory-utilization {m['flags_for_budget']['--gpu-memory-utilization']:g} gives it "
            "in either mode")


def _suffix(opts: ServeOptions) -> str:
    parts = ([f"spec {opts.draft_tokens} draft"] if opts.draft_tokens else []) + (["fp4 indexer"] if opts.indexer == "fp4" else [])
    return ", " + ", ".join(parts) if parts else ""
