"""vLLM's KV cache for DeepSeek-V4 (0.33.x, 0.34.x) in kvatlas's measures: per group and per cache kind.

What vLLM builds (`KVCacheConfig`): `num_blocks` blocks of `bytes_per_block` in ONE backing
allocation (`allocate_kv_cache` asserts every `KVCacheTensor` has the same size and makes one
buffer); each `KVCacheTensor` is a set of per-layer views into it (layer l of block b at
`offset + l * layer_stride + b * block_stride`), so their sizes sum to a multiple of the
allocation. The five groups overlay the same bytes: a block serves one group at a time, and the
group uses `page_bytes` of its `bytes_per_block` (the rest is pad: physical, never useful).

The pools kvatlas reports (tensor bytes partition the one allocation, each block counted once,
under whoever owns it now):
- one pool per cache kind and group (`swa_kv.0`, `swa_kv.1`, `c4_kv`, `c4_indexer`, `c128_kv`,
  `c4_state`, `c4_indexer_state`, `c128_state`): the bytes its layers take of the blocks the group
  owns (held by requests, or cached and held by nobody). occupied = those bytes; evictable = the
  part in cached blocks nobody holds; occupied − evictable is what running requests hold;
- `block_pad.<group>`: the bytes of the group's blocks no layer of it uses (physical, 0 addressable);
- `free_blocks` (free and holding no prefix-cache entry), `null_block` (block 0, never handed out),
  `unattributed` (held blocks of no known group: 0 while the census is exact).
planned is vLLM's own sizing: its "GPU KV cache size" assumes each of `num_blocks / Σ r_g`
requests takes r_g blocks of every group g (`cdiv(max_memory_usage_bytes, page_size_bytes)`), so
group g is planned `num_blocks × r_g / Σ r` blocks (floored; the remainder is planned free).

0.34's extensible cache (on by default on CUDA): the worker reserves address space for the planned
blocks (`reserved_blocks`) and, after warm-up, commits physical pages to the count vLLM measured
(`committed_blocks`), which becomes the scheduler's `num_blocks`. The pools above then cover the
committed blocks (tensor = reserved = physical = their bytes), and one more, `uncommitted`, holds
the reserved address range beyond them (reserved bytes, no physical ones). So in total reserved ≥
physical = committed blocks × bytes per block (vLLM's own physical figure rounds each segment up
to the 2 MiB VMM granule).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ...cache.ledger import ZERO, Measures
from ...units import cdiv
from ..foreign import SCHEMA_VERSION, ForeignSnapshot, Occupancy, PoolState

ENGINE = "vllm"
KINDS = {"swa_kv": ("kv", "swa"), "c4_kv": ("kv", "c4"), "c128_kv": ("kv", "c128"), "c4_indexer": ("indexer", "c4"),
         "c4_state": ("state", "c4"), "c4_indexer_state": ("state", "c4"), "c128_state": ("state", "c128")}
_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True, slots=True, kw_only=True)
class KindPart:
    pool: str
    role: str
    layer_kind: str
    layers: int
    bytes_per_block: int     # of every block its group owns


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupLayout:
    index: int
    name: str
    layer_kind: str
    block_tokens: int
    window: int | None       # None: full attention
    page_bytes: int          # what the group's layers use of one block
    parts: tuple[KindPart, ...]
    request_blocks: int      # vLLM's per-request maximum (its capacity figure's r_g)
    planned_blocks: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolLayout:
    num_blocks: int
    bytes_per_block: int
    allocation_bytes: int            # the one backing buffer
    tensor_entries: int              # KVCacheTensor views of it
    tensor_entries_bytes: int        # their sizes summed (each counts the whole buffer)
    groups: tuple[GroupLayout, ...]
    planned_free_blocks: int
    budget_bytes: int | None
    labels: dict
    logged_tokens: int | None        # vLLM's "GPU KV cache size"
    logged_concurrency: float | None
    cache_block_size: int            # cache_config.block_size, as cache_config_info shows it
    max_model_len: int
    max_num_seqs: int
    full_tokens: int                 # tokens of full KV the pool holds beside max_num_seqs requests' windows
    reserved_blocks: int = 0         # 0.34's extensible cache: blocks of address space reserved (0: not extensible)
    committed_blocks: int = 0        # and committed to physical memory by the latest extension
    released: bool = False           # the KV cache's memory is released (sleep, release_kv_cache_memory)

    @property
    def extensible(self) -> bool:
        return self.reserved_blocks > 0

    def extended(self, reserved_blocks: int, committed_blocks: int) -> "PoolLayout":
        """This layout under an extensible cache: `reserved_blocks` of address space, of which
        `committed_blocks` have physical pages (vLLM's pool uses `num_blocks` of them)."""
        if not reserved_blocks >= committed_blocks >= self.num_blocks > 0:
            raise ValueError(f"extensible cache of {reserved_blocks:,} reserved, {committed_blocks:,} committed blocks "
                             f"cannot back a pool of {self.num_blocks:,}")
        return replace(self, reserved_blocks=reserved_blocks, committed_blocks=committed_blocks)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def full_block_tokens(self) -> int:
        return max(g.block_tokens for g in self.groups if g.window is None)


def cache_kind(layer_name: str, ratios) -> str:
    """A DeepSeek-V4 cache module's kind, from the name vLLM registers it under."""
    m = _LAYER.search(layer_name + ".")
    i = int(m.group(1)) if m else -1
    ratio = max(1, ratios[i]) if 0 <= i < len(ratios) else 1
    if layer_name.endswith(".swa_cache"):
        return "swa_kv"
    if layer_name.endswith(".indexer.k_cache"):
        return "c4_indexer"
    if layer_name.endswith(".indexer.compressor.state_cache"):
        return "c4_indexer_state"
    if layer_name.endswith(".compressor.state_cache"):
        return f"c{ratio}_state"
    return f"c{ratio}_kv"


def layout_of(kv_cache_config, vllm_config, budget_bytes: int | None = None, labels: dict | None = None) -> PoolLayout:
    from vllm.transformers_utils.deepseek_v4_utils import get_compress_ratios
    cfg = kv_cache_config
    ratios = get_compress_ratios(vllm_config.model_config.hf_config)
    stride = {name: t.layer_stride for t in cfg.kv_cache_tensors for name in t.layers}
    sizes = {t.size for t in cfg.kv_cache_tensors}
    if len(sizes) != 1 or len({t.block_stride for t in cfg.kv_cache_tensors}) != 1:
        raise ValueError(f"KV cache tensors of {len(sizes)} sizes: not vLLM's one backing allocation")
    bpb = cfg.kv_cache_tensors[0].block_stride
    request_blocks = [cdiv(g.kv_cache_spec.max_memory_usage_bytes(vllm_config), g.kv_cache_spec.page_size_bytes)
                      for g in cfg.kv_cache_groups]
    planned = [cfg.num_blocks * r // sum(request_blocks) for r in request_blocks]
    groups = []
    for i, g in enumerate(cfg.kv_cache_groups):
        by_kind: dict[str, list[str]] = {}
        for name in g.layer_names:
            by_kind.setdefault(cache_kind(name, ratios), []).append(name)
        parts = [(kind, len(names), sum(stride[n] for n in names)) for kind, names in by_kind.items()]
        window = getattr(g.kv_cache_spec, "sliding_window", None)
        groups.append((i, parts, g.kv_cache_spec.block_size, window))
    named = _name_groups([[k for k, _, _ in parts] for _, parts, _, _ in groups])
    layouts = tuple(GroupLayout(
        index=i, name=named[i], layer_kind=_kind_of(parts), block_tokens=block, window=window,
        page_bytes=sum(b for _, _, b in parts), request_blocks=request_blocks[i], planned_blocks=planned[i],
        parts=tuple(KindPart(pool=_pool_name(kind, named[i]), role=KINDS[kind][0], layer_kind=KINDS[kind][1],
                             layers=n, bytes_per_block=b) for kind, n, b in parts))
        for i, parts, block, window in groups)
    cache, sched = vllm_config.cache_config, vllm_config.scheduler_config
    max_len = vllm_config.model_config.max_model_len
    return PoolLayout(num_blocks=cfg.num_blocks, bytes_per_block=bpb, allocation_bytes=sizes.pop(),
                      tensor_entries=len(cfg.kv_cache_tensors), tensor_entries_bytes=sum(t.size for t in cfg.kv_cache_tensors),
                      groups=layouts, planned_free_blocks=cfg.num_blocks - sum(planned), budget_bytes=budget_bytes,
                      labels=dict(labels or rank_labels(vllm_config)), logged_tokens=cache.kv_cache_size_tokens,
                      logged_concurrency=cache.kv_cache_max_concurrency, cache_block_size=cache.block_size,
                      max_model_len=max_len, max_num_seqs=sched.max_num_seqs,
                      full_tokens=_full_tokens(cfg.num_blocks - 1, layouts, vllm_config))


def _name_groups(kinds_per_group: list[list[str]]) -> list[str]:
    """swa.0, swa.1 (the SWA groups in order), mla, c4_state, c128_state: kvatlas's names."""
    base = []
    for kinds in kinds_per_group:
        s = set(kinds)
        base.append("swa" if s == {"swa_kv"} else "mla" if s <= {"c4_kv", "c4_indexer", "c128_kv"}
                    else "c4_state" if s <= {"c4_state", "c4_indexer_state"} else "c128_state" if s == {"c128_state"}
                    else "group")
    out, seen = [], {}
    for b in base:
        n = seen[b] = seen.get(b, -1) + 1
        out.append(f"{b}.{n}" if b == "swa" or base.count(b) > 1 else b)
    return out


def _pool_name(kind: str, group: str) -> str:
    return f"{kind}.{group.split('.', 1)[1]}" if "." in group else kind


def _kind_of(parts) -> str:
    kinds = {KINDS[k][1] for k, _, _ in parts}
    return kinds.pop() if len(kinds) == 1 else "all"


def _full_tokens(usable: int, groups, vllm_config) -> int:
    """Tokens of full KV the pool holds while max_num_seqs requests run (all but one decoding, one
    in chunked prefill): kvatlas's model of vLLM's planner (`compare`), fed vLLM's own groups."""
    from ...engines.vllm import serving_sliding_blocks, sliding_blocks_per_request
    sched = vllm_config.scheduler_config
    spec = vllm_config.speculative_config
    step = 1 + (spec.num_speculative_tokens if spec is not None else 0)
    in_flight = (2 if sched.async_scheduling else 1) * sched.max_num_batched_tokens
    max_len = vllm_config.model_config.max_model_len
    held, peak = {}, {}
    for g in groups:
        if g.window is not None:
            _, peak[g.name], held[g.name] = sliding_blocks_per_request(g.window, g.block_tokens, in_flight, max_len, step)
    sliding = sum(serving_sliding_blocks(held, peak, sched.max_num_seqs).values())
    full = [g.block_tokens for g in groups if g.window is None]
    return max(usable - sliding, 0) * (max(full) if full else 0)


def rank_labels(vllm_config) -> dict:
    """dp_rank: the engine core's data-parallel rank (vLLM's own `engine` label). The scheduler's
    config is every tensor-parallel worker's (vLLM plans them alike): tp_rank/pp_rank are "0" on a
    single worker and "each" where several hold the same figures."""
    par = vllm_config.parallel_config
    return {"tp_rank": "0" if par.tensor_parallel_size == 1 else "each",
            "pp_rank": "0" if par.pipeline_parallel_size == 1 else "each",
            "dp_rank": str(par.data_parallel_rank or 0)}


# ---- one snapshot: O(pools), from the census's counters -------------------------------------

def _m(planned=0, tensor=0, addressable=0, occupied=0, evictable=0) -> Measures:
    return Measures(planned_bytes=planned, tensor_bytes=tensor, reserved_bytes=tensor, physical_bytes=tensor,
                    addressable_bytes=addressable, occupied_bytes=occupied, evictable_bytes=evictable)


def snapshot(layout: PoolLayout, counts) -> ForeignSnapshot:
    bpb, pools = layout.bytes_per_block, {}
    for g in layout.groups:
        owned, cached = counts.held[g.index] + counts.cached[g.index], counts.cached[g.index]
        for p in g.parts:
            b = p.bytes_per_block
            pools[p.pool] = _state(p.pool, p.role, p.layer_kind, g.name, _m(
                g.planned_blocks * b, owned * b, owned * b, owned * b, cached * b), layout, counts.held[g.index])
        pad = bpb - g.page_bytes
        if pad:
            pools[f"block_pad.{g.name}"] = _state(f"block_pad.{g.name}", "pad", g.layer_kind, None,
                                                  _m(g.planned_blocks * pad, owned * pad), layout, 0)
    unknown = counts.unattributed + counts.drift
    pools["free_blocks"] = _state("free_blocks", "free", "all", None, _m(
        layout.planned_free_blocks * bpb, counts.free_clean * bpb, counts.free_clean * bpb), layout, 0)
    pools["null_block"] = _state("null_block", "null", "all", None, _m(tensor=bpb), layout, 0)
    pools["unattributed"] = _state("unattributed", "kv", "all", None, _m(
        tensor=unknown * bpb, addressable=unknown * bpb, occupied=unknown * bpb), layout, 0)
    if layout.extensible:
        # 0.34's extensible cache: the address range beyond the pool's blocks; committed blocks the
        # pool does not use (none after vLLM's own extension) have physical pages, the rest none
        spare = layout.committed_blocks - layout.num_blocks
        pools["uncommitted"] = _state("uncommitted", "reserve", "all", None, Measures(
            planned_bytes=0, tensor_bytes=spare * bpb,
            reserved_bytes=(layout.reserved_blocks - layout.num_blocks) * bpb,
            physical_bytes=spare * bpb, addressable_bytes=0, occupied_bytes=0, evictable_bytes=0), layout, 0)
    if layout.released:   # asleep: addresses and views stay, the physical pages are gone until wake-up
        pools = {k: replace(p, measures=replace(p.measures, physical_bytes=0)) for k, p in pools.items()}
    kinds, total = {}, ZERO
    for p in pools.values():
        kinds[p.layer_kind] = kinds.get(p.layer_kind, ZERO) + p.measures
        total = total + p.measures
    return ForeignSnapshot(schema_version=SCHEMA_VERSION, engine=ENGINE, labels=layout.labels, pools=pools,
                           layer_kinds=kinds, kv_cache=total, total=total, budget_bytes=layout.budget_bytes,
                           over_budget_bytes=None if layout.budget_bytes is None else
                           layout.allocation_bytes - layout.budget_bytes,
                           unreachable_bytes=bpb, occupancy=occupancy(layout, counts),
                           notes={"num_blocks": layout.num_blocks, "bytes_per_block": bpb,
                                  "logged_tokens": layout.logged_tokens, "full_tokens": layout.full_tokens,
                                  "reserved_blocks": layout.reserved_blocks or layout.num_blocks,
                                  "committed_blocks": layout.committed_blocks or layout.num_blocks})


class SampleMap:
    """Every metric sample of a snapshot is affine in the census's counts (blocks times fixed bytes),
    so the map from counts to sample values is taken once, from the snapshot code itself evaluated
    at the zero counts and at each unit count, and a stats interval is one small matrix product."""

    def __init__(self, layout: PoolLayout) -> None:
        import numpy as np

        from ..foreign import samples
        from .census import Counts
        g = len(layout.groups)

        def counts(i: int = -1) -> Counts:
            unit = [1 if j == i else 0 for j in range(2 * g + 2)]
            return Counts(held=tuple(unit[:g]), cached=tuple(unit[g:2 * g]), unattributed=unit[2 * g],
                          free=unit[2 * g + 1], usable=layout.usable_blocks)
        rows = samples(snapshot(layout, counts()))
        self.keys = [r[:3] for r in rows]
        self.offset = np.array([r[3] for r in rows], dtype=np.float64)
        cols = [np.array([r[3] for r in samples(snapshot(layout, counts(i)))]) - self.offset for i in range(2 * g + 2)]
        self.matrix = np.stack(cols, axis=1)

    def values(self, counts):
        import numpy as np
        state = np.array(counts.held + counts.cached + (counts.unattributed, counts.free), dtype=np.float64)
        return self.offset + self.matrix @ state


def _state(name, role, kind, space, measures, layout, used) -> PoolState:
    return PoolState(name=name, role=role, layer_kind=kind, index_space=space, measures=measures,
                     units_total=layout.usable_blocks if space else 0, units_used=used)


def occupancy(layout: PoolLayout, counts) -> tuple[Occupancy, ...]:
    """Blocks per group (held, cached and held by nobody) and of the shared pool."""
    rows = [Occupancy(pool=g.name, layer_kind=g.layer_kind, unit="blocks", used=counts.held[g.index],
                      evictable=counts.cached[g.index]) for g in layout.groups]
    held = layout.usable_blocks - counts.free
    rows.append(Occupancy(pool="blocks", layer_kind="all", unit="blocks", used=held, free=counts.free_clean,
                          total=layout.usable_blocks, evictable=sum(counts.cached)))
    return tuple(rows)


def startup_line(layout: PoolLayout) -> str:
    r, bpb = layout.labels, layout.bytes_per_block
    groups = ", ".join(f"{g.name} {g.block_tokens} tokens/{g.page_bytes:,} B" for g in layout.groups)
    logged = ("" if layout.logged_tokens is None else
              f"; vLLM logs 'GPU KV cache size: {layout.logged_tokens:,} tokens' ({layout.logged_concurrency:.2f}x "
              f"max_model_len {layout.max_model_len:,}: a concurrency, it moves with max_model_len)")
    if layout.extensible:
        head = extension_line(layout)
    else:
        head = (f"kvatlas: vLLM DeepSeek-V4 KV cache dp{r['dp_rank']}: {layout.num_blocks:,} blocks x {bpb:,} B = "
                f"{layout.allocation_bytes:,} B in one allocation ({layout.tensor_entries} KVCacheTensors view it); "
                f"it holds {layout.full_tokens:,} tokens of full KV beside {layout.max_num_seqs:,} running requests' "
                f"windows")
    return f"{head}{logged}; a block per group (cache_config block_size {layout.cache_block_size} is the smallest): {groups}"


def extension_line(layout: PoolLayout) -> str:
    """What vLLM 0.34's extensible cache reserved and committed, in bytes and in tokens, beside the
    line vLLM logs for the same extension."""
    r, bpb = layout.labels, layout.bytes_per_block
    return (f"kvatlas: vLLM DeepSeek-V4 KV cache dp{r['dp_rank']} (extensible): reserved {layout.reserved_blocks:,} "
            f"blocks x {bpb:,} B = {layout.reserved_blocks * bpb:,} B of address space; committed after warm-up "
            f"{layout.committed_blocks:,} blocks = {layout.committed_blocks * bpb:,} B (vLLM logs 'Extended KV cache "
            f"to {layout.committed_blocks} blocks'), which hold {layout.full_tokens:,} tokens of full KV beside "
            f"{layout.max_num_seqs:,} running requests' windows")
