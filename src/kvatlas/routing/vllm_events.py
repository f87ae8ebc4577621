"""vLLM's KV-event wire (0.33 and 0.34, `vllm/distributed/kv_events.py`), decoded into kvatlas's
events (`events.py`). All knowledge of vLLM's wire lives here.

The wire, as vLLM's ZMQ publisher sends it:
- a multipart message `(topic, seq, payload)`: `seq` 8 bytes big-endian (the replay socket's end
  marker is -1, signed), `payload` msgpack;
- the payload is an `EventBatch`, a msgpack array `[ts, events, data_parallel_rank]` (the rank may
  be absent: msgspec omits defaults);
- each event a map tagged `"type"`: `BlockStored{block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window, locality, ownership, session_id, lookahead_token_ids}`,
  `BlockRemoved{block_hashes, medium, group_idx, ...}`, `AllBlocksCleared{}`; a field equal to
  None is omitted.

Decoded by msgspec against typed structs (in C, the fastest msgpack decoder for Python). Anything
else raises `MalformedEventError` naming the field; unknown extra fields and unknown event types a
newer vLLM may add are rejected too (an index that skipped a store it could not read would predict
hits that are not there). A `BlockStored`'s `token_ids` are checked for their count only (from the
array's header) and handed on undecoded (`WireTokens`): the index decodes the full group's, as one
batch, before it applies any of it, and raises `MalformedEventError` then if they are not token
ids; a sliding group's are never read (the index needs their hashes and parents only).
"""

from __future__ import annotations

from array import array
from typing import Any

import msgpack
import msgspec
import numpy as np

from .digest import U32_CODE
from .events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, MalformedEventError, MEDIA, hash_key

END_SEQ = -1


# vLLM's structs, as typed decoding reads them (msgspec, in C): a field of the wrong type, an unknown
# field or an unknown event type fails the whole batch with the field's path. `token_ids` stays in its
# msgpack bytes (`WireTokens`): most of a batch is token ids, and only the full group's are ever read.
class _Stored(msgspec.Struct, tag="BlockStored", tag_field="type", kw_only=True, forbid_unknown_fields=True):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None
    lookahead_token_ids: msgspec.Raw | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", tag_field="type", kw_only=True, forbid_unknown_fields=True):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", forbid_unknown_fields=True):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


_BATCH = msgspec.msgpack.Decoder(_Batch)
_IDS = msgspec.msgpack.Decoder(list[int])


class WireTokens:
    """A `BlockStored`'s token ids still in their msgpack bytes: counted from the array's header,
    decoded once when first asked for (`tokens_array()`: uint32). The index reads the full group's
    only; a sliding group's ids (four fifths of a DeepSeek-V4 batch) are never parsed."""

    __slots__ = ("raw", "field", "_n", "_array")

    def __init__(self, raw: msgspec.Raw, field: str) -> None:
        self.raw, self.field, self._array = raw, field, None
        self._n = _array_len(memoryview(raw), field)

    def __len__(self) -> int:
        return self._n

    def tokens_array(self) -> np.ndarray:
        if self._array is None:
            try:
                ids = _IDS.decode(self.raw)
                self._array = np.frombuffer(array(U32_CODE, ids), dtype=np.uint32)
            except (msgspec.DecodeError, OverflowError, TypeError) as exc:
                raise MalformedEventError(self.field, f"not token ids ({exc})") from None
        return self._array

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        a = self.tokens_array()
        return a if dtype is None else a.astype(dtype)

    def __iter__(self):
        return iter(self.tokens_array().tolist())

    def __getitem__(self, i):
        return self.tokens_array().tolist()[i]

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    __hash__ = None


def _array_len(raw: memoryview, field: str) -> int:
    """The element count of a msgpack array, from its header alone."""
    head = raw[0] if len(raw) else None
    if head is not None and 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head == 0xDC and len(raw) >= 3:
        return int.from_bytes(raw[1:3], "big")
    if head == 0xDD and len(raw) >= 5:
        return int.from_bytes(raw[1:5], "big")
    raise MalformedEventError(field, "missing or not an array")


def decode_seq(raw: bytes) -> int:
    """The 8-byte big-endian sequence number (signed: the replay end marker is -1)."""
    if not isinstance(raw, (bytes, bytearray, memoryview)) or len(raw) != 8:
        raise MalformedEventError("seq", f"{len(raw) if hasattr(raw, '__len__') else raw!r} bytes, not 8")
    return int.from_bytes(raw, "big", signed=True)


def decode_frames(frames) -> EventBatch:
    """A PUB message `(topic, seq, payload)` (or a replay reply `(b"", topic, seq, payload)`)."""
    frames = list(frames)
    if len(frames) == 4 and not frames[0]:
        frames = frames[1:]
    if len(frames) != 3:
        raise MalformedEventError("frames", f"{len(frames)} frames, not (topic, seq, payload)")
    return decode_payload(bytes(frames[2]), seq=decode_seq(frames[1]))


def decode_payload(payload: bytes, *, seq: int = -1) -> EventBatch:
    try:
        batch = _BATCH.decode(payload)
    except msgspec.ValidationError as exc:
        field, problem = _where(str(exc))
        raise MalformedEventError(field, problem) from None
    except msgspec.DecodeError as exc:
        raise MalformedEventError("payload", f"not msgpack ({exc})") from None
    rank = batch.data_parallel_rank
    if rank is not None and rank < 0:
        raise MalformedEventError("data_parallel_rank", f"{rank!r} is not a rank")
    events = tuple(_event(e, i) for i, e in enumerate(batch.events))
    return EventBatch(seq=seq, ts=batch.ts, events=events, dp_rank=rank)


_TOP = {"$": "payload", "$[0]": "ts", "$[1]": "events", "$[2]": "data_parallel_rank"}


def _where(message: str) -> tuple[str, str]:
    """msgspec's "problem - at `$[1][3].field`" → ("events[3].field", "problem")."""
    problem, sep, path = message.rpartition(" - at `")
    if not sep:
        return "payload", message
    path = path.rstrip("`")
    if path in _TOP:
        field = _TOP[path]
    elif path.startswith("$[1]["):
        field = "events" + path[4:]
    else:
        field = path
    if "`$[1]" not in message and problem.startswith("Expected `array`") and path == "$":
        problem = "not an EventBatch array [ts, events, data_parallel_rank]"
    return field, problem


def _event(e, i: int):
    if type(e) is _Stored:
        return _stored(e, i)
    if type(e) is _Removed:
        return BlockRemoved(block_hashes=_hashes(e.block_hashes, i), group=_group(e.group_idx, i),
                            medium=_medium(e.medium, i))
    return AllBlocksCleared()


def _stored(e: _Stored, i: int) -> BlockStored:
    hashes = _hashes(e.block_hashes, i)
    block = e.block_size
    if block <= 0:
        raise MalformedEventError(f"events[{i}].block_size", f"{block!r} is not a positive block size")
    tokens = WireTokens(e.token_ids, f"events[{i}].token_ids")
    n = len(tokens)
    if n % block or n < len(hashes) * block:
        raise MalformedEventError(f"events[{i}].token_ids", f"{n} tokens for {len(hashes)} blocks of {block}")
    parent = e.parent_block_hash
    extra = e.extra_keys
    return BlockStored(block_hashes=hashes, token_ids=tokens, block_tokens=block, group=_group(e.group_idx, i),
                       parent_hash=None if parent is None else hash_key(parent, f"events[{i}].parent_block_hash"),
                       medium=_medium(e.medium, i), lora_name=e.lora_name,
                       extra_keys=None if extra is None else tuple(map(_freeze, extra)),
                       kind=e.kv_cache_spec_kind, sliding_window_tokens=e.kv_cache_spec_sliding_window)


def _hashes(values: list, i: int) -> tuple[int, ...]:
    try:
        if not values or min(values) >= 0:     # ints (msgspec refused anything else but bytes): in C
            return tuple(values)
    except TypeError:
        pass                                   # bytes hashes (vLLM's default), or a mix
    return tuple(hash_key(v, f"events[{i}].block_hashes") for v in values)


def _group(group: int | None, i: int) -> int | None:
    if group is not None and group < 0:
        raise MalformedEventError(f"events[{i}].group_idx", f"{group!r} is not a group index")
    return group


def _medium(medium: str | None, i: int) -> str:
    if medium is None:
        return "GPU"
    upper = medium.upper()
    if upper not in MEDIA:
        raise MalformedEventError(f"events[{i}].medium", f"{medium!r} is not one of {', '.join(MEDIA)}")
    return upper


def _freeze(value):
    return tuple(map(_freeze, value)) if isinstance(value, list) else value


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload vLLM would publish for `batch` (tests and the harness's fakes use it;
    hashes go out as the 64-bit ints of VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    return msgpack.packb([batch.ts, [_encode_event(e) for e in batch.events], batch.dp_rank], use_bin_type=True)


def _encode_event(event) -> dict:
    if isinstance(event, BlockStored):
        out = {"type": "BlockStored", "block_hashes": list(event.block_hashes), "token_ids": list(event.token_ids),
               "block_size": event.block_tokens, "medium": event.medium, "group_idx": event.group,
               "parent_block_hash": event.parent_hash, "lora_name": event.lora_name,
               "kv_cache_spec_kind": event.kind, "kv_cache_spec_sliding_window": event.sliding_window_tokens}
    elif isinstance(event, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium,
               "group_idx": event.group}
    else:
        out = {"type": "AllBlocksCleared"}
    return {k: v for k, v in out.items() if v is not None}
