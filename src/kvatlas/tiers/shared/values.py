"""What a shared-tier value is: its key, its 64-byte header and its checksum.

A key names the content and everything that makes its bytes comparable:

    kvatlas/<namespace>/<layout tag>/<kind>/<page key, 16 hex digits>

`kind` is `p` (one full-token page of every host-page buffer) or `c` (a resume point). The layout
tag is 16 hex digits of a hash over the model's identity (the digest of its whole config, never
its name: two models in folders of one name are two models, one config in two folders is one),
the layout and row formats, the byte sizes of every buffer a value holds, the rank shape (tp, pp,
pp rank: a rank of another shape holds other layers or heads) and, for a bookkeeping run whose
payloads are modeled, its scale. Two caches whose tags agree read each other's values byte for
byte; the namespace separates deployments of one model.

The header (little-endian, 64 bytes) comes first in every value:

    magic "KVAT" | format version u16 | kind u8 | 0 u8 | layout hash u64 | page key u64 |
    boundary tokens u64 | payload bytes u64 | checksum u64 | writer u64 | 0 u64

A read is a hit only when the value is exactly header + the expected payload, the magic, version,
layout, key and boundary agree and the checksum holds; anything else is a miss with its reason,
and nothing is restored (`check`).

The checksum (format version 2) covers every range of the value: each payload range is hashed
with XXH3-64 (the `xxhash` package), then XXH3-64 of the header (its checksum field read as
zeros) followed by each payload range's length and hash, in value order, is the value's. Flipped,
zeroed, truncated, swapped or misplaced bytes anywhere — in a range, across ranges, in the header
— change it except with probability 2^-64. Chosen by measurement (bench/shared_checksum.py, a
restore batch of 16 V4-Flash pages and a resume point, 20 MB, on CI's 2-core machine, three runs
in bench/RESULTS.md): XXH3-64 15.7-17.8 GB/s on one thread, as fast as the version-1 word sum
(15.0-16.6) and faster than google-crc32c (5.9-13.9); the library releases the interpreter lock,
so a large batch's ranges are hashed on threads. Version 1
summed 8-byte words weighted by the range's position, which two compensating bit flips, two
swapped words or two swapped rows of one range left unchanged: its values now read as `stale`.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import xxhash

FORMAT_VERSION = 2
HEADER_BYTES = 64
MAGIC = b"KVAT"
KINDS = {"page": b"p", "checkpoint": b"c"}
_KIND_CODE = {"page": 1, "checkpoint": 2}
_HEADER = struct.Struct("<4sHBBQQQQQQQ")
_SUM_AT = 40     # the checksum field's offset in the header

# Why a shared-tier read was not a hit; every reason is exported, zeros too.
MISS_REASONS = ("absent", "stale", "foreign", "corrupt", "size_mismatch", "deadline", "tier_unavailable")


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """What makes two caches' values comparable, and the byte sizes of one value of each kind."""

    namespace: str
    layout_hash: int
    payload_bytes: dict     # kind -> bytes

    @property
    def tag(self) -> str:
        return f"{self.layout_hash:016x}"

    def key(self, kind: str, page_key: int) -> str:
        return f"kvatlas/{self.namespace}/{self.tag}/{KINDS[kind].decode()}/{int(page_key):016x}"


def model_identity(model) -> str:
    """What makes one model's KV another's: its config's digest (kvatlas.planning.model.config_digest),
    never its name (a folder's basename); a ModelSpec made by hand: a digest of all its fields."""
    if model.config_digest:
        return model.config_digest
    from dataclasses import replace
    return hashlib.blake2b(repr(replace(model, name="")).encode(), digest_size=16).hexdigest()


def layout_of(host_plan, device_plan, namespace: str = "default", modeled_scale: int = 0) -> Layout:
    """The Layout of a host plan's values (its buffers are what a value holds, in this order);
    `modeled_scale` > 0: a bookkeeping run's values (payloads of zeros, kvatlas.tiers.shared.tier),
    under a tag of their own so that a real run never meets them."""
    o = device_plan.options
    parts = [model_identity(device_plan.model), o.kv_layout, f"tp{o.tp}", f"pp{o.pp}.{o.pp_rank}",
             f"page{device_plan.page_tokens}", f"v{FORMAT_VERSION}"]
    if modeled_scale:
        parts.append(f"modeled1/{int(modeled_scale)}")
    for b in host_plan.buffers:
        parts.append(f"{b.name}:{b.dtype}:{b.unit_bytes}:{b.inner_shape}:{b.layers}")
    digest = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest()
    from ...planning.hostplan import HOST_CHECKPOINTS, HOST_PAGES
    return Layout(namespace=namespace, layout_hash=int.from_bytes(digest, "little"),
                  payload_bytes={"page": host_plan.unit_bytes(HOST_PAGES),
                                 "checkpoint": host_plan.unit_bytes(HOST_CHECKPOINTS)})


def checksum(head, parts) -> int:
    """The value's checksum: `head` its 64-byte header (the checksum field is not read), `parts`
    its payload ranges (uint8 arrays) in value order."""
    return checksums([(head, parts)])[0]


def checksums(values, pool=None, shares: int = 1) -> list[int]:
    """checksum() of each value, a (header, parts) pair; the ranges of them all are cut into
    `shares` runs of about equal bytes (whole ranges), all but the first hashed on `pool`'s
    threads (xxhash releases the interpreter lock)."""
    ranges = [(v, i, p) for v, (_, parts) in enumerate(values) for i, p in enumerate(parts)]
    total = sum(p.nbytes for _, _, p in ranges)
    if pool is None or shares < 2 or total < (2 << 20):   # under 2 MiB: not worth a hand-off
        runs = [ranges]
    else:
        runs, run, done, per = [], [], 0, total / shares
        for r in ranges:
            run.append(r)
            done += r[2].nbytes
            if done >= per * (len(runs) + 1) and len(runs) < shares - 1:
                runs.append(run)
                run = []
        runs.append(run)
    later = [pool.submit(_hash_ranges, r) for r in runs[1:] if r]
    sums = _hash_ranges(runs[0])
    for f in later:
        sums.update(f.result())
    out = []
    for v, (head, parts) in enumerate(values):
        h = bytearray(bytes(head[:HEADER_BYTES]))
        h[_SUM_AT:_SUM_AT + 8] = bytes(8)
        words = [x for i, p in enumerate(parts) for x in (p.nbytes, sums[(v, i)])]
        out.append(xxhash.xxh3_64_intdigest(bytes(h) + struct.pack(f"<{len(words)}Q", *words)))
    return out


def _hash_ranges(run) -> dict:
    return {(v, i): xxhash.xxh3_64_intdigest(p) for v, i, p in run}


def sealed(head, parts) -> bytes:
    """`head` (a header made with checksum 0) with the value's checksum filled in."""
    h = bytearray(bytes(head[:HEADER_BYTES]))
    h[_SUM_AT:_SUM_AT + 8] = checksum(h, parts).to_bytes(8, "little")
    return bytes(h)


def header(layout: Layout, kind: str, page_key: int, boundary_tokens: int, payload_bytes: int, digest: int,
           writer: int = 0) -> bytes:
    return _HEADER.pack(MAGIC, FORMAT_VERSION, _KIND_CODE[kind], 0, layout.layout_hash, int(page_key),
                        int(boundary_tokens), int(payload_bytes), int(digest), int(writer) & (2**64 - 1), 0)


@dataclass(frozen=True, slots=True)
class Header:
    magic: bytes
    version: int
    kind: int
    layout_hash: int
    page_key: int
    boundary_tokens: int
    payload_bytes: int
    checksum: int
    writer: int


def parse(raw) -> Header:
    m, v, k, _, lh, pk, bt, pb, cs, wr, _ = _HEADER.unpack(bytes(raw[:HEADER_BYTES]))
    return Header(m, v, k, lh, pk, bt, pb, cs, wr)


def check(layout: Layout, kind: str, page_key: int, boundary_tokens: int, got_bytes: int, raw_header,
          parts, value_bytes: int, digest: int | None = None) -> str | None:
    """None for a hit, else the miss reason. `got_bytes`: the value's length as the store read
    it; `value_bytes`: the length it must have; `parts`: the payload as read (None: a modeled
    payload, whose bytes are not checked); `digest`: the value's checksum when the caller made it."""
    if got_bytes != value_bytes:
        return "size_mismatch"
    h = parse(raw_header)
    if h.magic != MAGIC:
        return "corrupt"
    if h.version != FORMAT_VERSION:
        return "stale"
    if h.layout_hash != layout.layout_hash or h.kind != _KIND_CODE[kind] or h.page_key != int(page_key) \
            or h.boundary_tokens != int(boundary_tokens):
        return "foreign"
    if h.payload_bytes != layout.payload_bytes[kind]:
        return "size_mismatch"
    if parts is not None and (checksum(raw_header, parts) if digest is None else digest) != h.checksum:
        return "corrupt"
    return None
