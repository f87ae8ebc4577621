"""KvatlasCache: a transformers `Cache` for DeepSeek-V4 whose storage is a kvatlas KVCache.

Each batch row of a forward pass is one kvatlas request. A serving loop binds the rows itself
(`bind([...])`, after admitting them with their token ids, so the prefix cache can hit); plain
`model.generate(ids, past_key_values=cache)` binds nothing, and the first pass admits one
request per row (`reset()` finishes them). Every pass writes S new tokens for each bound row:
one kvatlas step (S = 1) or extend (a prefill chunk), begun when the first layer's `update`
arrives, so the indices are made once per pass (`passes.Pass`) and every layer reads them.
"""

from __future__ import annotations

import itertools

import numpy as np
from transformers.cache_utils import Cache

from ...cache.kvcache import KVCache
from ...checks import boolean, of_type
from ...checks import request_id as check_request_id
from ...datapath import LayerTargets
from ...errors import KvatlasError, RequestStateError
from .layers import CLASSES, Pooled
from .model import check_model, compressors, model_spec
from .passes import EntrySlots, Pass, Rings, Staging, SwaSlots

_names = itertools.count()


class _Merged:
    """The WriteIndices of one extend per row of a pass, as one (row-major, like a step's)."""

    __slots__ = ("swa_slots", "compressed", "checkpoint_rows")

    def __init__(self, parts, S: int) -> None:
        self.swa_slots = np.concatenate([w.swa_slots for w in parts])
        self.compressed = {r: (np.concatenate([w.compressed[r][0] for w in parts]),
                               np.concatenate([w.compressed[r][1] for w in parts])) for r in parts[0].compressed}
        rows: dict = {}
        for b, w in enumerate(parts):
            for name, (tok, row) in w.checkpoint_rows.items():
                rows.setdefault(name, []).append((tok + b * S, row))
        self.checkpoint_rows = {n: (np.concatenate([t for t, _ in v]), np.concatenate([r for _, r in v]))
                                for n, v in rows.items()}


def _group(layers, most: int) -> None:
    """The layers of each paged pool of compressed entries, in order, as one `Pooled` each."""
    members: dict = {}
    for layer in layers:
        for name, paged in getattr(layer, "pools", {}).items():
            members.setdefault((paged.target.buffer.data_ptr(), paged.target.geom.fmt.name), []).append((layer, name))
    for group in members.values():
        group.sort(key=lambda m: m[0].pools[m[1]].target.layer)
        pooled = Pooled([layer.pools[name] for layer, name in group], most)
        for k, (layer, name) in enumerate(group):
            layer.grouped[name] = (pooled, k)


class KvatlasCache(Cache):
    """`past_key_values` for a transformers DeepSeek-V4 model, stored in `kv` (a kvatlas KVCache
    planned for that model: see `kvatlas_cache_for`). `validate=True` checks every row stored
    (finite, in range: a device sync each); the default trusts the model's rows.
    `group_read_bytes`: in a pass that writes no entry to a pool, its layers' entries are read in
    groups holding up to this many bytes (`layers.Pooled`: one launch a group, not one a layer);
    0 reads layer by layer."""

    def __init__(self, kv: KVCache, model, *, validate: bool = False, group_read_bytes: int = 64 << 20) -> None:
        of_type("kv", kv, KVCache, "a kvatlas KVCache", "give kvatlas.allocate(plan_for(model, ...)), or use "
                "kvatlas_cache_for(model, memory)")
        spec = model_spec(check_model(model).config)
        boolean("validate", validate)
        if spec.compress_ratios[: spec.num_hidden_layers] != kv.plan.model.compress_ratios[: spec.num_hidden_layers]:
            raise KvatlasError("cache: it was planned for another model (compress_ratios differ); plan it from this "
                               "model's config")
        if kv.plan.options.online_c128:
            raise KvatlasError("online_c128: the model reads the raw rows since its last C128 window, which an "
                               "online row does not keep; plan with online_c128 off")
        self.kv, self.validate = kv, validate
        mods = compressors(model)
        layers = []
        for i, kind in enumerate(model.config.layer_types):
            targets = LayerTargets.of_cache(kv, i)
            cls = CLASSES[kind]
            layers.append(cls(self, i, targets) if kind == "sliding_attention" else cls(self, i, targets, mods[i]))
        super().__init__(layers=layers)
        if isinstance(group_read_bytes, bool) or not isinstance(group_read_bytes, int) or group_read_bytes < 0:
            raise KvatlasError(f"group_read_bytes: {group_read_bytes!r}; pass a byte count >= 0 (0 reads layer by layer)")
        _group(layers, group_read_bytes)
        self.current: Pass | None = None
        self._entries, self._rings, self._swa = EntrySlots(), Rings(), SwaSlots()
        self._staging = Staging(kv.device)
        self.request_ids: tuple = ()
        self._batch = None
        self._own: list = []          # requests the first pass admitted (generate): reset() finishes them
        self._tag = f"hf{next(_names)}"

    # ---------------------------------------------------------------- rows of the next passes
    def bind(self, request_ids) -> "KvatlasCache":
        """The running kvatlas requests the next forward passes write, one per batch row."""
        if request_ids is None or isinstance(request_ids, (str, bytes, dict)) or not hasattr(request_ids, "__iter__"):
            raise KvatlasError(f"request_ids: {type(request_ids).__name__} is not a list of request ids; give e.g. "
                               "['a', 'b'] (one per batch row), or () to unbind")
        ids = tuple(request_ids)
        for rid in ids:
            check_request_id(rid)
        if len(set(ids)) != len(ids):
            raise KvatlasError("request_ids: names a request twice; one batch row per request")
        a = self.kv.allocator
        for rid in ids:
            if rid not in a.slot_of:
                raise RequestStateError(f"request_id {rid!r} is not running; admit it to the KVCache first")
        if len({int(a.length[a.slot_of[r]]) for r in ids}) > 1:
            raise KvatlasError("bind: rows of one forward pass must have equal lengths (the model keeps one "
                               "window position per layer for the whole batch); run the others in their own pass")
        self.request_ids = ids
        self._batch = self.kv.batch(ids) if ids else None
        return self

    def seq_length(self) -> int:
        """Tokens the bound rows hold (0 when none is bound)."""
        if not self.request_ids:
            return 0
        a = self.kv.allocator
        return int(a.length[a.slot_of[self.request_ids[0]]])

    def _admit_rows(self, rows: int, tokens: int) -> None:
        ids = [f"{self._tag}-{len(self._own) + b}" for b in range(rows)]
        done = []
        try:
            for rid in ids:
                self.kv.admit(rid, tokens, 0)
                done.append(rid)
        except Exception:
            for rid in done:
                self.kv.finish(rid)
            raise
        self._own += ids
        self.bind(ids)

    def _begin(self, rows: int, tokens: int) -> None:
        if not self.request_ids:
            self._admit_rows(rows, tokens)
        if rows != len(self.request_ids):
            raise KvatlasError(f"forward: {rows} batch rows for {len(self.request_ids)} bound requests; bind one "
                               "request per row")
        a, kv = self.kv.allocator, self.kv
        if tokens == 1:
            w = kv.step(self._batch)
            slots = self._batch.slots          # (re-resolved by the step if an admission came between)
        else:
            if rows == 1:
                w = kv.extend(self.request_ids[0], tokens)
            else:
                with a.forward():
                    w = _Merged([kv.extend(rid, tokens) for rid in self.request_ids], tokens)
            slots = np.fromiter((a.slot_of[r] for r in self.request_ids), np.int64, rows)
        self.current = Pass(kv, slots, int(a.length[slots[0]]) - tokens, tokens, w, self._entries, self._rings,
                            self._staging, self._swa)

    # ---------------------------------------------------------------- the Cache interface
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == 0:   # the first layer of a pass: its indices, once
            self._begin(key_states.shape[0], key_states.shape[-2])
        return self.layers[layer_idx].update(key_states, value_states)

    def reorder_cache(self, beam_idx) -> None:
        """Beam search: row b continues the history of row beam_idx[b] (its contents are copied).
        `beam_idx`: one source row per bound row, each in [0, rows); checked before anything moves."""
        idx = np.asarray(beam_idx.tolist() if hasattr(beam_idx, "tolist") else beam_idx, dtype=object).reshape(-1)
        rows = len(self.request_ids)
        if len(idx) != rows or any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < rows
                                   for i in idx):
            raise KvatlasError(f"beam_idx: {_short(beam_idx)} is not one row index in [0, {rows}) for each of the "
                               f"{rows} bound rows; give a permutation (with repeats) of the batch rows")
        src = [self.request_ids[int(i)] for i in idx]
        pairs = [(s, d) for s, d in zip(src, self.request_ids) if s != d]
        if pairs:
            self.kv.copy_contents([s for s, _ in pairs], [d for _, d in pairs])

    def reset(self) -> None:
        """Finish the requests this cache admitted itself; nothing stays bound."""
        for rid in self._own:
            if rid in self.kv.allocator.slot_of:
                self.kv.finish(rid)
        self._own.clear()
        self.bind(())
        self.current = None

    def crop(self, tokens_to_remove: int) -> None:
        self.layers[0].crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise KvatlasError("batch_repeat_interleave: rows are kvatlas requests; admit and bind them instead")

    def batch_select_indices(self, indices) -> None:
        raise KvatlasError("batch_select_indices: rows are kvatlas requests; bind the ones to keep instead")

    @property
    def is_croppable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"KvatlasCache({len(self.layers)} layers, rows={list(self.request_ids)}, {self.kv.plan.options.kv_layout})"


def _short(value) -> str:
    r = repr(value)
    return r if len(r) <= 40 else r[:30] + "…"
