"""kvatlas's own KV-cache events: what an engine says it stored, removed or cleared, engine-neutral.

Each engine's wire is decoded into these by one module of its own (`vllm_events.py`); the index
(`index.py`) reads only these. Block hashes are the engine's, reduced to one unsigned 64-bit int
(`hash_key`): vLLM publishes either its 32-byte hash or, with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES,
the low 64 bits of it read big-endian; both reduce to the same int, so the index works with either.
The hash says where a prefix ends, not which group holds it: a block is always named by
(group, hash).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import KvatlasError

MEDIA = ("GPU", "CPU", "STORAGE")    # where a block lives, fastest first
_MASK64 = (1 << 64) - 1


class MalformedEventError(KvatlasError):
    """An event batch off the wire does not decode: raised with the field at fault and the fix
    (the subscriber counts it and drops the batch; the index never sees half of one)."""

    def __init__(self, field: str, problem: str, fix: str = "check the engine's KV event publisher version") -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}; {fix}")


def hash_key(value, field: str = "block_hashes") -> int:
    """One block hash as the index keys it: an int in [0, 2**64)."""
    if isinstance(value, bool):
        raise MalformedEventError(field, f"{value!r} is a bool, not a block hash")
    if isinstance(value, int):
        if value < 0:
            raise MalformedEventError(field, f"{value} is negative")
        return value & _MASK64
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if not raw:
            raise MalformedEventError(field, "an empty hash")
        return int.from_bytes(raw[-8:], "big")
    raise MalformedEventError(field, f"a {type(value).__name__} is not a block hash (bytes or int)")


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockStored:
    """Blocks of one group now cached. `token_ids` covers every block of the stored range, also
    the ones the engine did not keep (a sliding group keeps only the tails that can serve a hit),
    so `len(token_ids)` may exceed `len(block_hashes) * block_tokens`."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None          # the block before the range (None: the range starts at token 0)
    token_ids: Sequence[int]         # read-only: a list, an unsigned numpy array, or vllm_events.WireTokens
    block_tokens: int
    group: int | None                # None: an engine with one group
    medium: str = "GPU"
    lora_name: str | None = None
    extra_keys: tuple | None = None
    kind: str | None = None          # the group's spec kind, when the engine says it
    sliding_window_tokens: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    group: int | None
    medium: str = "GPU"


@dataclass(frozen=True, slots=True, kw_only=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (every group, every medium it publishes)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True, kw_only=True)
class EventBatch:
    """One published batch: what one engine step (or connector flush) changed, in order."""

    seq: int                         # the publisher's sequence number (-1: not known)
    ts: float                        # the engine's wall-clock time of the batch, seconds
    events: tuple[Event, ...]
    dp_rank: int | None = None
