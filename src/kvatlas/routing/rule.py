"""The hit rule a router needs for a DeepSeek-V4 model on vLLM, and the engine's KV cache groups.

Derived from vLLM's hybrid coordinator (`HybridKVCacheCoordinator.find_longest_cache_hit`, 0.33 and
0.34) and checked against it by tests/vllm_plugin/test_routing_oracle.py: a request of n tokens
resumes at the largest boundary b that is
- a multiple of the scheduler block (256 for DeepSeek-V4) and at most n - 1 (the last prompt
  token is always recomputed, for its logits);
- covered by the full group: every block of [0, b) resident;
- covered by every sliding group: the last cdiv(W - 1, block) blocks ending at b resident (all
  blocks of [0, b) when b is shorter), W the group's window: SWA (block 64, window 128): 2 blocks;
  C4 compressor state (block 4, window 8): 2; C128 compressor state (block 8, window 128): 16.
Speculative decoding (EAGLE/MTP) would need one block more per sliding group and a dropped last
block; the rule refuses it rather than predict wrong.

V4.1 (bounded replay): its SWA and compressor state are not prefix-cacheable, publish nothing and
do not take part; a hit needs the full group only (the engine replays the window's last tokens).
The events do not say which model it is, so the rule comes from the model's config (planning).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

FULL = "full"
SLIDING = "sliding"
_FULL_KINDS = ("full_attention", "mla_attention", "sink_full_attention")   # vLLM's KVCacheSpecKind values
SCHEDULER_BLOCK_TOKENS = 256       # what the DeepSeek-V4 backends force (every group's hit alignment)


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupSpec:
    """One KV cache group of an engine, as the hit rule needs it."""

    index: int
    kind: str                          # FULL or SLIDING
    block_tokens: int
    window_tokens: int | None = None   # sliding groups only

    @property
    def tail_blocks(self) -> int:
        """Blocks ending at a boundary that a hit there needs (sliding groups)."""
        if self.kind != SLIDING:
            return 0
        return max(1, -(-(self.window_tokens - 1) // self.block_tokens))

    def to_dict(self) -> dict:
        return {"group_idx": self.index, "kind": self.kind, "block_size": self.block_tokens,
                "sliding_window": self.window_tokens}


@dataclass(frozen=True, slots=True, kw_only=True)
class HitRule:
    """The model's side of the rule: its family, alignment, and the sliding kinds a hit needs
    (block tokens → window tokens), so a group is classified from its block size alone when the
    events do not name its kind (vLLM 0.33's GPU events do not)."""

    model: str
    family: str                                     # "v4" or "v4.1"
    align_tokens: int = SCHEDULER_BLOCK_TOKENS
    full_block_tokens: int = SCHEDULER_BLOCK_TOKENS
    sliding_windows: tuple[tuple[int, int], ...] = ()   # (block_tokens, window_tokens) per sliding kind

    @classmethod
    def for_model(cls, model) -> "HitRule":
        """The rule for a kvatlas model (preset name, config.json path or dict), from planning:
        the window of each cache vLLM keeps per layer (`engines.vllm.layer_caches`)."""
        from ..engines.vllm import layer_caches
        from ..planning.model import load_model, model_from_config
        from ..planning.options import ServeOptions
        spec = model_from_config(model) if isinstance(model, dict) else load_model(model)
        if spec.family == "v4.1":
            return cls(model=spec.name, family=spec.family)
        windows = sorted({(c.block_tokens, c.window) for c in layer_caches(spec, ServeOptions(indexer="fp8"))
                          if c.window is not None})
        return cls(model=spec.name, family=spec.family, sliding_windows=tuple(windows))

    @property
    def sliding_in_hit(self) -> bool:
        return self.family != "v4.1"

    def group_of(self, index: int, block_tokens: int, kind: str | None = None,
                 window_tokens: int | None = None) -> GroupSpec:
        """Classify a group the engine published (its block, and its kind/window when known)."""
        kind = (kind or "").lower()
        if kind in _FULL_KINDS:
            return GroupSpec(index=index, kind=FULL, block_tokens=block_tokens)
        if kind.startswith("sliding") and window_tokens:
            return GroupSpec(index=index, kind=SLIDING, block_tokens=block_tokens, window_tokens=window_tokens)
        if block_tokens == self.full_block_tokens and not kind.startswith("sliding"):
            return GroupSpec(index=index, kind=FULL, block_tokens=block_tokens)
        for block, window in self.sliding_windows:
            if block == block_tokens:
                return GroupSpec(index=index, kind=SLIDING, block_tokens=block, window_tokens=window)
        raise ConfigError(f"group {index}", f"a {block_tokens}-token block matches no cache of {self.model}",
                          "route with the model the engines serve (--model), or pass the groups' metadata")

    def required_sliding(self) -> tuple[tuple[int, int], ...]:
        """The sliding kinds every hit needs (an engine whose group of a kind has published nothing
        yet holds none of it: no hit)."""
        return self.sliding_windows if self.sliding_in_hit else ()

    def to_dict(self) -> dict:
        return {"model": self.model, "family": self.family, "align_tokens": self.align_tokens,
                "full_block_tokens": self.full_block_tokens,
                "sliding": [{"block_size": b, "sliding_window": w} for b, w in self.sliding_windows],
                "sliding_in_hit": self.sliding_in_hit}


def groups_from_metadata(rule: HitRule, metadata) -> tuple[GroupSpec, ...]:
    """Groups from vLLM 0.34's `EngineCore.get_kv_cache_group_metadata()`:
    `[{group_idx, kind, block_size, sliding_window}]`."""
    out = []
    for i, entry in enumerate(metadata):
        try:
            index, kind, block = int(entry["group_idx"]), entry.get("kind"), int(entry["block_size"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"metadata[{i}]", f"{entry!r} lacks group_idx/block_size",
                              "pass get_kv_cache_group_metadata()'s list as is") from None
        out.append(rule.group_of(index, block, kind, entry.get("sliding_window")))
    return tuple(out)
