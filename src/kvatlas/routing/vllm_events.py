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

Anything else raises `MalformedEventError` naming the field; unknown extra fields and unknown
event types a newer vLLM may add are rejected too (an index that skipped a store it could not read
would predict hits that are not there), except the fields listed in `_IGNORED`.
"""

from __future__ import annotations

import msgpack

from .events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, MalformedEventError, MEDIA, hash_key

END_SEQ = -1
_STORED_FIELDS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                  "locality", "ownership", "session_id", "lookahead_token_ids"}
_REMOVED_FIELDS = {"type", "block_hashes", "medium", "group_idx", "locality", "ownership"}


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
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:   # msgpack raises several unrelated types for bad bytes
        raise MalformedEventError("payload", f"not msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(batch, list) or not 2 <= len(batch) <= 3:
        raise MalformedEventError("payload", "not an EventBatch array [ts, events, data_parallel_rank]")
    ts, raw_events = batch[0], batch[1]
    rank = batch[2] if len(batch) == 3 else None
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise MalformedEventError("ts", f"{ts!r} is not a time")
    if not isinstance(raw_events, list):
        raise MalformedEventError("events", "not an array")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
        raise MalformedEventError("data_parallel_rank", f"{rank!r} is not a rank")
    events = tuple(_event(e, i) for i, e in enumerate(raw_events))
    return EventBatch(seq=seq, ts=float(ts), events=events, dp_rank=rank)


def _event(raw, i: int):
    if not isinstance(raw, dict):
        raise MalformedEventError(f"events[{i}]", "not a map")
    kind = raw.get("type")
    if kind == "BlockStored":
        return _stored(raw, i)
    if kind == "BlockRemoved":
        _only(raw, _REMOVED_FIELDS, i)
        return BlockRemoved(block_hashes=_hashes(raw, i), group=_group(raw, i), medium=_medium(raw, i))
    if kind == "AllBlocksCleared":
        _only(raw, {"type"}, i)
        return AllBlocksCleared()
    raise MalformedEventError(f"events[{i}].type", f"{kind!r} is not BlockStored, BlockRemoved or AllBlocksCleared")


def _stored(raw: dict, i: int) -> BlockStored:
    _only(raw, _STORED_FIELDS, i)
    hashes = _hashes(raw, i)
    block = raw.get("block_size")
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
        raise MalformedEventError(f"events[{i}].block_size", f"{block!r} is not a positive block size")
    tokens = raw.get("token_ids")
    if not isinstance(tokens, list):
        raise MalformedEventError(f"events[{i}].token_ids", "missing or not an array")
    if len(tokens) % block or len(tokens) < len(hashes) * block:
        raise MalformedEventError(f"events[{i}].token_ids",
                                  f"{len(tokens)} tokens for {len(hashes)} blocks of {block}")
    parent = raw.get("parent_block_hash")
    window = raw.get("kv_cache_spec_sliding_window")
    extra = raw.get("extra_keys")
    return BlockStored(block_hashes=hashes, token_ids=tokens, block_tokens=block, group=_group(raw, i),
                       parent_hash=None if parent is None else hash_key(parent, f"events[{i}].parent_block_hash"),
                       medium=_medium(raw, i), lora_name=_str(raw, "lora_name", i),
                       extra_keys=None if extra is None else tuple(map(_freeze, extra)),
                       kind=_str(raw, "kv_cache_spec_kind", i),
                       sliding_window_tokens=window if isinstance(window, int) and not isinstance(window, bool) else None)


def _only(raw: dict, allowed: set, i: int) -> None:
    unknown = set(raw) - allowed
    if unknown:
        raise MalformedEventError(f"events[{i}]", f"unknown fields {sorted(map(str, unknown))}",
                                  "this decoder reads vLLM 0.33/0.34's events")


def _hashes(raw: dict, i: int) -> tuple[int, ...]:
    values = raw.get("block_hashes")
    if not isinstance(values, list):
        raise MalformedEventError(f"events[{i}].block_hashes", "missing or not an array")
    return tuple(hash_key(v, f"events[{i}].block_hashes") for v in values)


def _group(raw: dict, i: int) -> int | None:
    group = raw.get("group_idx")
    if group is not None and (not isinstance(group, int) or isinstance(group, bool) or group < 0):
        raise MalformedEventError(f"events[{i}].group_idx", f"{group!r} is not a group index")
    return group


def _medium(raw: dict, i: int) -> str:
    medium = raw.get("medium")
    if medium is None:
        return "GPU"
    if not isinstance(medium, str) or medium.upper() not in MEDIA:
        raise MalformedEventError(f"events[{i}].medium", f"{medium!r} is not one of {', '.join(MEDIA)}")
    return medium.upper()


def _str(raw: dict, key: str, i: int) -> str | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, str):
        raise MalformedEventError(f"events[{i}].{key}", f"{value!r} is not a string")
    return value


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
