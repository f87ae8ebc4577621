"""The per-layer cache objects the model reaches into (`past_key_values.layers[i]`), backed by
kvatlas pools. transformers' DeepSeek-V4 calls, per layer and forward pass:

- `update(kv, kv)` (every layer: the sliding window): the new rows go to the layer's SWA pages;
  it returns the window before the pass and every new row, [B, 1, W + S, 512];
- `store_compression_weights(name, kv, gate)` (C4: "compressor" and "indexer"; C128:
  "compressor"): the new tokens' raw projections go to the compressor-state ring; it returns the
  longest run of whole windows (what was buffered since the last window, then the new tokens) and
  the position of its first token;
- `update_overlap_state(name, chunk_kv, chunk_gate, head_dim)` (C4, when a window closes): the
  first halves of the block before this pass's first window, kv and gate with its position bias;
- `update_compressor_states(name, compressed)`: the new compressed entries go to their paged pool
  (C4 / C128 KV, indexer keys); it returns exactly the T entries so far, [B, T, width].

What each returns is read back from the pools (so the fp8 layout hands the model what an engine
would read), in the dtype the model passed in.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ...datapath import entries_view, layer_ops, store
from ...errors import KvatlasError
from .passes import Kept

_STATE_POOLS = {("c4", "compressor"): "c4_state", ("c4", "indexer"): "c4_indexer_state",
                ("c128", "compressor"): "c128_state"}


class _Paged:
    """One layer's slice of a paged pool. Raw formats (the exact layouts) are read and written
    through their entries view with the pass's (page, offset) pairs: one indexing operation a
    call, what the model's own cache spends on its concatenation; the others through the Triton
    kernels with their fixed arguments made once (`layer_ops`, CUDA), else gather and store."""

    __slots__ = ("target", "view", "ops")

    def __init__(self, target) -> None:
        self.target = target
        self.view = entries_view(target.geom, target.buffer, target.layer, codec=target.codec)
        self.ops = None if self.view is not None else layer_ops(target)

    def read(self, span, head: bool = False):
        """The span's entries, [B, count, width] (with `head`, [B, 1, count, width]: the keys a
        layer's single KV head attends)."""
        if self.view is None:
            if self.ops is not None:
                return self.ops.gather(span.flat, (span.B, 1, span.count, self.ops.width) if head else
                                       (span.B, span.count, self.ops.width))
            got = self.target.gather(span.slots)
            return got.unsqueeze(1) if head else got
        B, n = span.pages.shape
        got = self.view.index_select(0, span.pages.reshape(-1))
        if head:
            return got.view(B, 1, -1, self.view.shape[-1])[:, :, span.start: span.start + span.count]
        return got.view(B, -1, self.view.shape[-1])[:, span.start: span.start + span.count]

    def write(self, where, rows, validate: bool) -> None:
        t = self.target
        if validate:
            store(t.geom, t.buffer, t.layer, where.slots, rows, parallel=t.parallel, codec=t.codec)
        elif self.view is not None:
            self.view[where.at] = rows if rows.dtype == self.view.dtype else rows.to(self.view.dtype)
        elif self.ops is not None:
            self.ops.store(where.slots, rows)
        else:
            t.store(where.slots, rows)


class Pooled:
    """The layers of one paged pool (C4 or C128 entries, or indexer keys), read together. In a
    pass that writes no entry to the pool (most decode steps: a C4 window closes every 4 tokens,
    a C128 one every 128), the pool does not change while the model goes through its layers, so
    the first layer to ask reads every layer's span at once and each takes its own: one launch
    (or one index_select) for a group of layers instead of one a layer; what a layer gets is
    what its own read returns. A group's read holds at most `most` bytes (the peak a pass adds
    per pool, the first taker's read kept until the group's last layer takes its part; 0: each
    layer reads alone, as in a pass that writes the pool)."""

    __slots__ = ("pageds", "view", "ops", "target", "most")

    def __init__(self, pageds: list, most: int) -> None:
        self.pageds, self.most = pageds, most
        t = self.target = pageds[0].target
        self.view, self.ops = None, {}
        if [p.target.layer for p in pageds] != list(range(t.layer, t.layer + len(pageds))) or t.parallel is not None:
            self.most = 0              # not consecutive layers of one buffer: no group reads
        elif pageds[0].view is not None:
            self.view = entries_view(t.geom, t.buffer, range(t.layer, t.layer + len(pageds)),
                                     codec=t.codec).transpose(0, 1)   # [layers, units, entries, width]
        elif pageds[0].ops is None:
            self.most = 0              # the torch path (no Triton): each layer reads alone

    def read(self, p, k: int, span, alone: bool):
        """Layer k's (its place in `pageds`) entries of `span`, [B, count, width]."""
        got = p.reads.get(self)        # (first layer, the group's parts) of the group read last
        if got is not None and not alone and 0 <= k - got[0] < len(got[1]):
            parts = got[1]
            if k - got[0] == len(parts) - 1:   # the group's last layer: the pass keeps it no longer
                del p.reads[self]
            return parts[k - got[0]]
        if not self.most or alone:
            return self.pageds[k].read(span)
        n, t = len(self.pageds), self.target
        if self.view is None:          # the kernels read out bf16 values, span.count a row
            each = span.B * span.count * t.codec.width * 2
        else:                          # whole pages, in the format's dtype
            each = span.pages.numel() * t.geom.entries * t.codec.width * self.view.element_size()
        g = min(n, self.most // max(each, 1))
        if g <= 1:
            return self.pageds[k].read(span)
        j = k // g * g
        parts = self._read(span, j, min(g, n - j)).unbind(0)
        if len(parts) > 1 + k - j:
            p.reads[self] = (j, parts)
        return parts[k - j]

    def _read(self, span, j: int, g: int):
        B, count = span.B, span.count
        if self.view is not None:
            pages = span.pages
            got = self.view[j: j + g].index_select(1, pages.reshape(-1))
            return got.view(g, B, -1, got.shape[-1])[:, :, span.start: span.start + count]
        ops = self.ops.get((j, g))
        if ops is None:
            ops = self.ops[j, g] = layer_ops(self.pageds[j].target, g)
        return ops.gather(span.flat, (g, B, count, self.target.codec.width))


class SlidingLayer(CacheLayerMixin):
    """A sliding-window-only layer; the base of the compressed ones."""

    is_sliding = True
    kind = "swa"

    def __init__(self, owner, layer_idx: int, targets) -> None:
        super().__init__()
        self.owner, self.layer_idx, self.swa = owner, layer_idx, _Paged(targets.swa)
        self.stepped = self.swa.ops is not None and self.swa.ops.steps   # the one-launch decode step
        self.window = owner.kv.allocator.window
        self.is_initialized = True   # its storage is the pools, allocated already

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states=None, *args, **kwargs):
        p = self.owner.current
        B, _, S, D = key_states.shape
        if B == 1 and S == 1 and self.stepped and not self.owner.validate:
            # one request's decode step: the row stored and the window read in one launch (the
            # row's slot is the last of the window's)
            span = p.swa_read
            full = self.swa.ops.step(span.flat, key_states, (1, 1, span.count, D))
            full = full if full.dtype == key_states.dtype else full.to(key_states.dtype)
            return full, full
        self.swa.write(p.swa_store, key_states.reshape(B * S, D), self.owner.validate)
        full = self.swa.read(p.swa_read, head=True)
        full = full if full.dtype == key_states.dtype else full.to(key_states.dtype)
        return full, full

    def get_seq_length(self) -> int:
        return self.owner.seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """As transformers' sliding-window layer: keys seen before the query, then the query's."""
        seen = self.owner.seq_length()
        return min(seen, self.window - 1) + query_length, max(seen - self.window + 1, 0)

    def get_max_length(self) -> int:
        return self.window

    def reset(self) -> None:   # the owner finishes its requests (KvatlasCache.reset)
        pass

    def reorder_cache(self, beam_idx) -> None:   # the owner moves whole requests (KvatlasCache.reorder_cache)
        pass

    def crop(self, tokens_to_remove: int) -> None:
        raise KvatlasError("crop: a DeepSeek-V4 cache cannot be rolled back through transformers (its compressor "
                           "windows are stateful); use KVCache.rollback on the requests instead")

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


class CompressedLayer(SlidingLayer):
    """A C128 layer ("heavily_compressed_attention"): one compressor, no overlap, no indexer."""

    kind = "c128"
    names = ("compressor",)

    def __init__(self, owner, layer_idx: int, targets, modules: dict) -> None:
        super().__init__(owner, layer_idx, targets)
        kv = owner.kv
        rings = {"compressor": targets.kv, "indexer": targets.index}
        self.rings = {n: rings[n] for n in self.names}
        self.states = {n: r.state[:, r.layer] for n, r in self.rings.items()}   # [slot, ring row, kv | gate]
        # per name: the ratio, the ring, the key of a pass's RingRows for it, the projections' width
        self.fixed = {n: (r.ratio, self.states[n], (r.state.shape[2], r.ratio), r.state.shape[-1] // 2)
                      for n, r in self.rings.items()}
        self.pools = {n: _Paged(r.pool) for n, r in self.rings.items()}
        self.grouped: dict = {}   # name: (its pool's Pooled, this layer's place in it); set by the owner
        self.modules = modules
        self.ckpt = {}
        for n in self.names:
            ck = kv.pools.get(f"ckpt.{_STATE_POOLS[self.kind, n]}")
            if ck is not None:
                self.ckpt[n] = (ck.name, ck.tensor[:, ck.layer_position(layer_idx)])
        self._prior: dict = {}
        self._dtypes: dict = {}
        self._empty: dict = {}
        self._rows = Kept(256)   # (name, slot): its ring rows, each as [1, 1, 2 * width] (a decode step's write)

    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        p = self.owner.current
        ratio, state, ring_key, width = self.fixed[name]
        rr = p.rings[ring_key]
        if kv.shape[-1] != width:
            raise KvatlasError(f"{name}: {kv.shape[-1]}-wide projections for a {2 * width}-wide ring row; the "
                               "cache was planned for another model")
        buffered = p.L0 % ratio
        usable = (buffered + kv.shape[1]) // ratio * ratio
        # what the model pools: read before this pass's rows land in the ring, and only when a
        # window closes (else the model looks at no row of it: most decode steps)
        held = state[rr.buffer] if buffered and usable else None
        if rr.overlap is not None and usable:          # the model reads the overlap only when a window closes
            self._prior[name] = state[rr.overlap]
            self._dtypes[name] = (kv.dtype, gate.dtype)
        else:
            self._prior[name] = None
        if rr.one is not None:      # a decode step of one row: concatenated into its ring row, no scatter
            rows = self._ring_row(name, state, rr.one)
            torch.cat((kv, gate), -1, out=rows)
        else:
            rows = torch.cat((kv, gate), -1)
            new = rows if not rr.write_from else rows[:, rr.write_from:]
            state[rr.write] = new if new.dtype == state.dtype else new.to(state.dtype)
        if name in self.ckpt:                        # prefix cache: rows a resume point keeps
            saved = p.checkpoints.get(self.ckpt[name][0])
            if saved is not None and saved[0].numel():
                tok, unit, row = saved
                dst = self.ckpt[name][1]
                dst[unit, row] = rows.reshape(-1, 2 * width)[tok].to(dst.dtype)
        first = p.L0 - buffered
        if not usable:
            return (*self._none(name, kv, gate), first)
        if held is not None:
            kv = torch.cat((held[..., :width].to(kv.dtype), kv), 1)
            gate = torch.cat((held[..., width:].to(gate.dtype), gate), 1)
        if usable == kv.shape[1]:
            return kv, gate, first
        return kv[:, :usable], gate[:, :usable], first

    def _ring_row(self, name: str, state, one: tuple):
        """The ring row `one` (slot, row) as [1, 1, 2 * width]: views of every row of the slot,
        made in one operation the first time the slot's ring is written this way and kept (for
        the last 256 slots and names)."""
        slot, row = one
        rows = self._rows.get((name, slot))
        if rows is None:
            rows = self._rows.keep((name, slot), state[slot].unsqueeze(1).unsqueeze(1).unbind(0))
        return rows[row]

    def _none(self, name: str, kv, gate) -> tuple:
        """No window closes (most decode steps): the same empty pair each time."""
        key = (name, kv.shape[0], kv.dtype, gate.dtype)
        got = self._empty.get(key)
        if got is None:
            got = self._empty[key] = (kv[:, :0].clone(), gate[:, :0].clone())
        return got

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        pool, r = self.pools[name], self.rings[name].ratio
        p = self.owner.current
        B, n, D = compressed.shape
        if n != p.new_counts[r]:
            raise KvatlasError(f"{name}: the model closed {n} windows where the cache counts {p.new_counts[r]}; "
                               "the cache and the model disagree on the sequence")
        if n:
            pool.write(p.new_entries[r], compressed.reshape(B * n, D), self.owner.validate)
        span = p.read_entries[r]
        if not span.count:
            return compressed
        group = self.grouped.get(name)
        out = pool.read(span) if group is None else group[0].read(p, group[1], span, alone=bool(n))
        return out if out.dtype == compressed.dtype else out.to(compressed.dtype)


class SparseLayer(CompressedLayer):
    """A C4 layer ("compressed_sparse_attention"): compressor and lightning indexer, overlapped windows."""

    kind = "c4"
    names = ("compressor", "indexer")

    def update_overlap_state(self, name: str, chunk_kv, chunk_gate, head_dim: int):
        """The block before this pass's first window (read from the ring before the pass wrote it):
        kv and gate first halves, the gate with the position bias the window added."""
        prior = self._prior.pop(name, None)
        if prior is None:
            return None, None
        kv_dtype, gate_dtype = self._dtypes[name]
        width = prior.shape[-1] // 2
        bias = self.modules[name].position_bias.detach()
        gate = prior[..., width:width + head_dim].to(gate_dtype) + bias[:, :head_dim]
        return prior[..., :head_dim].to(kv_dtype), gate


CLASSES = {"sliding_attention": SlidingLayer, "heavily_compressed_attention": CompressedLayer,
           "compressed_sparse_attention": SparseLayer}
