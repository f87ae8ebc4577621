"""The exact prefix index: for each engine (replica, DP rank), which blocks each KV cache group
holds on each medium, learned from the engine's events only; and the predictor that turns a
prompt into each replica's resumable prefix under the model's hit rule (`rule.py`).

Keys. A block is named by (group, engine hash): vLLM publishes one hash per prefix end, the same
for every group whose block ends there, so the full group's block [0,256), an SWA block [192,256),
a C4-state block [252,256) and a C128-state block [248,256) share a hash and only the group tells
them apart. Several copies of one (group, hash) may be cached at once: each is counted, and a
`BlockRemoved` takes one away.

Matching a prompt without the engine's hash. The full group's blocks are placed on the prompt by
the router's own digest (`digest.py`): a `BlockStored` of the full group carries its tokens and its
parent, so the digest of each block's prefix follows from the parent's (or from token 0). The key
of a block is one int, (its block count from token 0 << 64) | the digest there: the full group's
table keeps hash → key, and `by_key` key → hash, both naming the same int object (two dict entries
and two ints a block: the index's memory is mostly these). A sliding group keeps only the tail blocks that can serve a
hit: runs of `tail_blocks` blocks ending at a 256-aligned boundary, whose last block shares its hash
with the full group's block there (the anchor). The index keeps, for each anchor, the hash of the
block at each offset before it; hash values are content-determined, so the offset map is shared by
every group and never needs the tokens. A run split over two steps is joined through the second
event's parent. What cannot be placed (a parent never seen, LoRA or salted prefixes) is counted in
`unplaced_blocks` and never predicted as a hit. A sliding group's table keeps hash → copies; the
full group's keeps one copy per entry, further copies of one (medium, group, hash) counted in `dups`.

The prediction for a prompt of n tokens: the full group's run of resident blocks from token 0
(`main_group_tokens`, what a main-group router scores), then the largest 256-aligned b ≤ min(that,
n - 1) where every sliding group has its tail ending at b — vLLM's fixed point, reached directly.
Per medium: GPU alone (`device_tokens`), then GPU+CPU and GPU+CPU+STORAGE for what a restore adds.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

from ..errors import ConfigError
from .digest import Digester
from .events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, MEDIA
from .rule import FULL, SLIDING, GroupSpec, HitRule

_M64 = (1 << 64) - 1
_GOLD = 0x9E3779B97F4A7C15
_UNPLACED = -1                  # a full-group block whose prefix is not known (no key)
_PARTIAL = -2                   # a full-group entry shorter than its block (vLLM's partial entries)
_MEDIA_SETS = (("GPU",), ("GPU", "CPU"), ("GPU", "CPU", "STORAGE"))


def _first(item):
    return item[0]


def _offset_key(anchor: int, offset_tokens: int) -> int:
    return ((anchor * _GOLD) & _M64) ^ offset_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """One replica's answer for one prompt (the best of its DP ranks; `rank` says which)."""

    replica: str
    rank: int
    prompt_tokens: int
    device_tokens: int       # the exact prefix the engine resumes from on its device
    cpu_tokens: int          # beyond device_tokens, what blocks on CPU would add if restored
    storage_tokens: int      # beyond those, what STORAGE would add
    recompute_tokens: int    # the rest: prompt_tokens - device - cpu - storage
    main_group_tokens: int   # the full group alone (what Dynamo/SMG/llm-d score)
    stale: bool              # the index may miss events of this engine (see `stale_reason` in state())

    @property
    def prefill_tokens(self) -> int:
        """Tokens the engine computes if it restores nothing."""
        return self.prompt_tokens - self.device_tokens

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


@dataclass(frozen=True, slots=True)
class PromptKeys:
    """A prompt's digests at every full-group block boundary: compute once, predict for all."""

    prompt_tokens: int
    keys: tuple[int, ...] | list[int]
    block_tokens: int


class _Engine:
    """One engine's blocks. Mutated by one subscriber thread, read by the request path: `lock`."""

    def __init__(self, rule: HitRule, digester: Digester, groups: Iterable[GroupSpec] = (),
                 max_pending_runs: int = 4096) -> None:
        self.rule, self.digester = rule, digester
        self.lock = threading.Lock()
        self.groups: dict[int, GroupSpec] = {g.index: g for g in groups}
        self.fixed_groups = set(self.groups)     # from the engine's metadata: never relearned
        self.learned: set[int] = set()
        self.max_pending_runs = max_pending_runs
        self.stale_reason: str | None = None
        self.counters = {"batches": 0, "stored_blocks": 0, "removed_blocks": 0, "clears": 0,
                         "unplaced_blocks": 0, "unknown_removals": 0}
        self.last_batch_ts: float | None = None
        self._reset()

    def _reset(self) -> None:
        # medium → group → table: a sliding group's hash → copies; a full group's hash → its key
        # ((block count << 64) | digest), _UNPLACED or _PARTIAL, one copy (more in `dups`)
        self.res: dict[str, dict[int, dict[int, int]]] = {m: {} for m in MEDIA}
        self.dups: dict[tuple[str, int, int], int] = {}   # (medium, full group, hash) → copies beyond one
        self.by_key: dict[int, int] = {}     # key → full-group hash
        self._full_tables: list[dict] | None = None       # every full group's table on every medium
        self._shape_cache = None
        self.back: dict[int, int] = {}       # (anchor hash, offset) → hash of the block that far before it
        self.pending: OrderedDict = OrderedDict()   # (group, last hash) → run awaiting its anchor

    # ---- groups --------------------------------------------------------------------------------

    def group(self, index: int | None, block: int, kind: str | None = None, window: int | None = None) -> GroupSpec:
        """The group an event names. The full group also publishes one-hash-unit entries for a
        prompt's tail inside its last block (vLLM's partial entries, used only by fine-grained hits):
        same group, smaller block. A group learned from such an entry (no metadata given) is
        reclassified when its first whole block arrives."""
        index = 0 if index is None else index
        spec = self.groups.get(index)
        if spec is None:
            spec = self.groups[index] = self.rule.group_of(index, block, kind, window)
            self._full_tables = self._shape_cache = None
            if index not in self.fixed_groups:
                self.learned.add(index)
        elif spec.block_tokens != block:
            if spec.kind == FULL and spec.block_tokens % block == 0:
                return spec
            if index in self.learned and block == self.rule.full_block_tokens:
                was = spec
                spec = self.groups[index] = self.rule.group_of(index, block, kind, window)
                self._full_tables = self._shape_cache = None
                if spec.kind == FULL and was.kind != FULL:
                    self._entries_were_partial(index)
                return spec
            raise ConfigError(f"group {index}", f"published {block}-token blocks, learned as {spec.block_tokens}",
                              "the engine's group layout changed: restart the router's subscription")
        return spec

    def _entries_were_partial(self, group: int) -> None:
        """A group first seen through smaller entries, now known as the full group: what it holds
        were partial entries (hash → copies until now)."""
        for m in MEDIA:
            table = self.res[m].get(group)
            for h, copies in list((table or {}).items()):
                table[h] = _PARTIAL
                if copies > 1:
                    self.dups[(m, group, h)] = copies - 1

    def full_groups(self) -> list[int]:
        return [g.index for g in self.groups.values() if g.kind == FULL]

    def sliding_groups(self) -> list[GroupSpec]:
        return [g for g in self.groups.values() if g.kind == SLIDING] if self.rule.sliding_in_hit else []

    def missing_kinds(self) -> bool:
        """A sliding kind the model has but no group of which has been seen: no hit is possible."""
        seen = {g.block_tokens for g in self.sliding_groups()}
        return any(block not in seen for block, _ in self.rule.required_sliding())

    # ---- events ----------------------------------------------------------------------------------

    def apply(self, batch: EventBatch) -> None:
        batch_anchors = set()
        for e in batch.events:
            if isinstance(e, BlockStored):
                spec = self.group(e.group, e.block_tokens, e.kind, e.sliding_window_tokens)
                if spec.kind == FULL and spec.block_tokens == e.block_tokens:
                    batch_anchors.update(e.block_hashes)
                    if hasattr(e.token_ids, "tokens_array"):
                        e.token_ids.tokens_array()   # decoded now: a malformed one fails the batch before any change
        for e in batch.events:
            if isinstance(e, BlockStored):
                self._stored(e, batch_anchors)
            elif isinstance(e, BlockRemoved):
                self._removed(e)
            elif isinstance(e, AllBlocksCleared):
                self.counters["clears"] += 1
                self._reset()
        self.counters["batches"] += 1
        self.last_batch_ts = batch.ts

    def _table(self, medium: str, group: int) -> dict:
        table = self.res[medium].get(group)
        if table is None:
            table = self.res[medium][group] = {}
            self._full_tables = self._shape_cache = None
        return table

    def full_tables(self) -> list[dict]:
        if self._full_tables is None:
            full = set(self.full_groups())
            self._full_tables = [t for m in MEDIA for g, t in self.res[m].items() if g in full]
        return self._full_tables

    def _place_of(self, h: int) -> int | None:
        """A full-group block's key (or _UNPLACED) on any medium; None where no full table holds it
        as a whole block."""
        found = None
        for t in self.full_tables():
            v = t.get(h)
            if v is not None and v != _PARTIAL:
                if v >= 0:
                    return v
                found = v
        return found

    def _stored(self, e: BlockStored, batch_anchors: set) -> None:
        spec = self.group(e.group, e.block_tokens, e.kind, e.sliding_window_tokens)
        table = self._table(e.medium, spec.index)
        hashes = e.block_hashes
        self.counters["stored_blocks"] += len(hashes)
        keyed = e.lora_name is None and not (e.extra_keys and any(k is not None for k in e.extra_keys))
        if spec.kind != FULL:
            for h in hashes:
                table[h] = table.get(h, 0) + 1
            if keyed:
                self._place_run(e, spec, batch_anchors)
            else:
                self.counters["unplaced_blocks"] += len(hashes)
            return
        if spec.block_tokens != e.block_tokens:     # a partial entry: never part of an aligned hit
            self._put(table, e.medium, spec.index, hashes, [_PARTIAL] * len(hashes))
            return
        self._put(table, e.medium, spec.index, hashes, self._keys_full(e, keyed))

    def _put(self, table: dict, medium: str, group: int, hashes, values) -> None:
        by_key = self.by_key
        for h, v in zip(hashes, values):
            old = table.get(h)
            if old is not None:
                self.dups[(medium, group, h)] = self.dups.get((medium, group, h), 0) + 1
                if old >= 0 or v < 0 or old == _PARTIAL:
                    continue
            table[h] = v
            if v >= 0:
                by_key[v] = h

    def _keys_full(self, e: BlockStored, keyed: bool) -> list[int]:
        """Each stored block's key, or _UNPLACED (its existing key, if another medium placed it)."""
        block, hashes = e.block_tokens, e.block_hashes
        start = 0 if e.parent_hash is None else self._place_of(e.parent_hash)
        if not keyed or start is None or start == _UNPLACED or len(e.token_ids) != len(hashes) * block:
            self.counters["unplaced_blocks"] += len(hashes)
            out = []
            for h in hashes:
                v = self._place_of(h)
                out.append(_UNPLACED if v is None else v)
            return out
        first = start >> 64
        return self.digester.block_keys(e.token_ids, block, first, start & _M64)

    def _place_run(self, e: BlockStored, spec: GroupSpec, batch_anchors: set) -> None:
        before = spec.tail_blocks - 1
        run = list(self.pending.pop((spec.index, e.parent_hash), ())) if e.parent_hash is not None else []
        for h in e.block_hashes:
            if h in batch_anchors or self._place_of(h) is not None:
                if len(run) > before:
                    self.counters["unplaced_blocks"] += len(run) - before
                for j in range(1, min(len(run), before) + 1):
                    self.back[_offset_key(h, j * spec.block_tokens)] = run[-j]
                run = []
            else:
                run.append(h)
        if run:
            if before == 0 or len(run) > before:
                self.counters["unplaced_blocks"] += len(run) - before if before else len(run)
                run = run[-before:] if before else []
            if run:
                self.pending[(spec.index, run[-1])] = tuple(run)
                while len(self.pending) > self.max_pending_runs:
                    self.counters["unplaced_blocks"] += len(self.pending.popitem(last=False)[1])
        if len(self.back) > 4096 and len(self.back) > 2 * self._sliding_blocks():
            self._compact_back()

    def _removed(self, e: BlockRemoved) -> None:
        spec = self.groups.get(0 if e.group is None else e.group)
        table = self.res[e.medium].get(spec.index) if spec is not None else None
        full = spec is not None and spec.kind == FULL
        for h in e.block_hashes:
            value = table.get(h) if table is not None else None
            if value is None:
                self.counters["unknown_removals"] += 1
                continue
            self.counters["removed_blocks"] += 1
            if not full:
                if value > 1:
                    table[h] = value - 1
                else:
                    del table[h]
                continue
            dup = (e.medium, spec.index, h)
            extra = self.dups.get(dup)
            if extra:
                if extra > 1:
                    self.dups[dup] = extra - 1
                else:
                    del self.dups[dup]
                continue
            del table[h]
            if value >= 0 and self.by_key.get(value) == h and self._place_of(h) is None:
                del self.by_key[value]

    def _sliding_blocks(self) -> int:
        return sum(len(t) for m in MEDIA for g, t in self.res[m].items() if self.groups[g].kind == SLIDING)

    def _compact_back(self) -> None:
        live = set()
        for m in MEDIA:
            for g, t in self.res[m].items():
                if self.groups[g].kind == SLIDING:
                    live.update(t)
        self.back = {k: v for k, v in self.back.items() if v in live}

    # ---- prediction ------------------------------------------------------------------------------

    def _shape(self) -> tuple[list[int], list[GroupSpec], bool]:
        """(full groups, sliding groups, no hit possible yet): what predict needs of the groups."""
        if self._shape_cache is None:
            self._shape_cache = (self.full_groups(), self.sliding_groups(), self.missing_kinds())
        return self._shape_cache

    def predict(self, prompt: PromptKeys) -> tuple[int, int, int, int]:
        """(device, +cpu, +storage resumable tokens, main-group tokens) for one prompt."""
        align = self.rule.align_tokens
        cap = max(prompt.prompt_tokens - 1, 0) // align
        full, sliding, impossible = self._shape()
        if not full or prompt.block_tokens != align or not prompt.keys or prompt.keys[0] not in self.by_key:
            return 0, 0, 0, 0       # (the prompt's first block placed nowhere: no medium holds any of it)
        out, main = [], 0
        for n, media in enumerate(_MEDIA_SETS):
            if n and not any(self.res[m] for m in media[1:]):
                out.append(out[-1])
                continue
            hashes = self._full_run(prompt.keys, full, media)
            if n == 0:
                main = len(hashes) * align
            best = 0
            if not impossible:
                best = self._boundary(hashes, min(len(hashes), cap), sliding, media)
            out.append(best)
        return out[0], out[1], out[2], main

    def _full_run(self, keys, full: list[int], media) -> list[int]:
        """The full group's resident blocks along the prompt's keys, from token 0."""
        tables = [[t for t in (self.res[m].get(g) for m in media) if t] for g in full]
        run = []
        if not tables or not all(tables):
            return run
        by_key = self.by_key
        if len(tables) == 1 and len(tables[0]) == 1:          # one full group on one medium: the common case
            # in C (map), not a Python loop: the prompt's blocks up to the first the table lacks
            hashes = list(map(by_key.get, keys))
            held = list(map(tables[0][0].__contains__, hashes))   # (None, for a key not placed: False)
            return hashes[:held.index(False)] if False in held else hashes
        for k in keys:
            h = by_key.get(k)
            if h is None or not all(any(h in t for t in ts) for ts in tables):
                break
            run.append(h)
        return run

    def _boundary(self, hashes: list[int], top: int, sliding: list[GroupSpec], media) -> int:
        """The largest b <= top (in blocks of the full group) where every sliding group's tail
        ending at b is resident; in tokens. Each group's anchor (its block ending at b) is checked
        first, so a boundary without tails costs one lookup."""
        align = self.rule.align_tokens
        if not sliding:
            return top * align
        groups = []
        for g in sliding:
            tables = [t for t in (self.res[m].get(g.index) for m in media) if t]
            if not tables:
                return 0
            groups.append((len(tables[0]) if len(tables) == 1 else sum(map(len, tables)), g, tables))
        groups.sort(key=_first)     # the sparsest group rules most boundaries out
        first_tables = groups[0][2]
        if len(first_tables) == 1:     # the boundaries where the sparsest group has its anchor, found in C
            candidates = list(itertools.compress(range(1, top + 1), map(first_tables[0].__contains__, hashes[:top])))
        else:
            candidates = [b for b in range(1, top + 1) if any(hashes[b - 1] in t for t in first_tables)]
        if not candidates:
            return 0
        back = self.back
        for b in reversed(candidates):
            anchor = hashes[b - 1]
            end = b * align
            mixed = (anchor * _GOLD) & _M64        # _offset_key(anchor, ·), its anchor part once
            for _, spec, tables in groups:
                if len(tables) == 1:               # one medium (the device): no generator per lookup
                    table = tables[0]
                    if anchor not in table:
                        break
                    block = spec.block_tokens
                    for j in range(1, min(spec.tail_blocks, -(-end // block))):
                        h = back.get(mixed ^ (j * block))
                        if h is None or h not in table:
                            break
                    else:
                        continue
                    break
                if not self._tail(spec, tables, anchor, end):
                    break
            else:
                return end
        return 0

    def _tail(self, spec: GroupSpec, tables, anchor: int, end_tokens: int) -> bool:
        if not any(anchor in t for t in tables):
            return False
        block = spec.block_tokens
        for j in range(1, spec.tail_blocks):
            if end_tokens - j * block <= 0:
                break
            h = self.back.get(_offset_key(anchor, j * block))
            if h is None or not any(h in t for t in tables):
                return False
        return True

    def state(self) -> dict:
        blocks = {m: {str(g): len(t) for g, t in sorted(self.res[m].items()) if t} for m in MEDIA}
        return {"groups": [g.to_dict() for _, g in sorted(self.groups.items())],
                "blocks": {m: v for m, v in blocks.items() if v},
                "placed_full_blocks": len(self.by_key), "offset_entries": len(self.back),
                "pending_runs": len(self.pending), "stale_reason": self.stale_reason,
                "last_batch_ts": self.last_batch_ts, **self.counters}


class PrefixIndex:
    """Every engine's blocks, and the predictor. Thread-safe: subscribers apply batches from their
    threads while the request path predicts."""

    def __init__(self, rule: HitRule | str | dict, *, digester: Digester | None = None,
                 max_pending_runs: int = 4096) -> None:
        self.rule = rule if isinstance(rule, HitRule) else HitRule.for_model(rule)
        self.digester = digester or Digester()
        self.max_pending_runs = max_pending_runs
        self._engines: dict[tuple[str, int], _Engine] = {}
        self._lock = threading.Lock()

    def add_engine(self, replica: str, rank: int = 0, groups: Iterable[GroupSpec] = ()) -> None:
        """Register an engine (optional: `apply` registers one it has not seen); `groups` from the
        engine's metadata (`rule.groups_from_metadata`) when known."""
        with self._lock:
            self._engines.setdefault((replica, rank), _Engine(self.rule, self.digester, groups, self.max_pending_runs))

    def remove_engine(self, replica: str, rank: int = 0) -> None:
        with self._lock:
            self._engines.pop((replica, rank), None)

    def engines(self) -> list[tuple[str, int]]:
        return sorted(self._engines)

    def _engine(self, replica: str, rank: int) -> _Engine:
        eng = self._engines.get((replica, rank))
        if eng is None:
            self.add_engine(replica, rank)
            eng = self._engines[(replica, rank)]
        return eng

    def apply(self, replica: str, rank: int, batch: EventBatch) -> None:
        """Apply one decoded batch of (replica, rank)'s events, in the order published."""
        eng = self._engine(replica, rank)
        with eng.lock:
            eng.apply(batch)

    def clear(self, replica: str, rank: int = 0) -> None:
        """Forget what the engine holds (its events were lost and it said nothing since)."""
        eng = self._engine(replica, rank)
        with eng.lock:
            eng._reset()

    def mark_stale(self, replica: str, rank: int = 0, reason: str | None = "events lost") -> None:
        """Flag (reason) or unflag (None) an engine whose events the index may have missed."""
        self._engine(replica, rank).stale_reason = reason

    def version(self, replica: str) -> int:
        """Changes whenever a batch of the replica's events is applied (any rank) or it is cleared:
        what a waiter polls before predicting again."""
        return sum(eng.counters["batches"] + eng.counters["clears"] for (r, _), eng in list(self._engines.items())
                   if r == replica)

    def keys(self, token_ids) -> PromptKeys:
        align = self.rule.align_tokens
        from .digest import as_tokens
        tokens = as_tokens(token_ids)
        return PromptKeys(len(tokens), self.digester.block_keys(tokens, align), align)

    def predict(self, token_ids, replicas: Iterable[str] | None = None) -> dict[str, Prediction]:
        """{replica: Prediction} for a prompt (its token ids, or `keys(token_ids)`), the best DP rank
        of each replica (most device tokens)."""
        prompt = token_ids if isinstance(token_ids, PromptKeys) else self.keys(token_ids)
        wanted = None if replicas is None else set(replicas)
        out: dict[str, Prediction] = {}
        for (replica, rank), eng in list(self._engines.items()):
            if wanted is not None and replica not in wanted:
                continue
            with eng.lock:
                device, cpu, storage, main = eng.predict(prompt)
            n = prompt.prompt_tokens
            p = Prediction(replica=replica, rank=rank, prompt_tokens=n, device_tokens=device,
                           cpu_tokens=cpu - device, storage_tokens=storage - cpu, recompute_tokens=n - storage,
                           main_group_tokens=main, stale=eng.stale_reason is not None)
            if replica not in out or p.device_tokens > out[replica].device_tokens:
                out[replica] = p
        return out

    def state(self) -> dict:
        """A JSON-able snapshot: the rule, and per engine its groups, block counts, counters."""
        engines = {}
        for (replica, rank), eng in sorted(self._engines.items()):
            with eng.lock:
                engines.setdefault(replica, {})[str(rank)] = eng.state()
        return {"rule": self.rule.to_dict(), "engines": engines}
