"""Audit any Python object graph for the torch storages it keeps alive, to the byte.

`audit(obj)` answers "where did the memory go" for objects that do no accounting of their own
(an engine's pool class, a model, a dict of caches): it walks the graph breadth-first and counts
every underlying storage once, however many views, slices or aliases reach it.

What it reads, and why only that:
- instance `__dict__` and `__slots__` values (read through the defining class's member
  descriptor), never `getattr`: a property may allocate, sync a device or raise, and an audit
  must not change or depend on what it measures;
- list, tuple (NamedTuple fields by name), deque, set, frozenset items and dict values (keys
  too when they are tensors).
It never descends into tensors (their attributes are torch internals), classes, modules,
functions or methods (shared by everything: walking them would count the world).

A storage is keyed by (device, storage data_ptr); its bytes are `untyped_storage().nbytes()`,
i.e. the whole allocation a view keeps alive, not the view's own elements. Meta tensors, empty
storages and tensors without a storage (sparse, some wrapper subclasses) count 0 bytes, each as
its own entry with a note. A container reached by several paths is walked once, under its first
path, so tensors inside it list that path only. Set items are visited in set iteration order,
which for tensors (hashed by id) may change from run to run.

torch is imported inside `audit()` so `import kvatlas` stays torch-free.
"""

from __future__ import annotations

import types
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Iterator

from ..errors import ConfigError

# A path is a chain (parent, segment), rendered only when a tensor is recorded: building full
# strings per object would cost O(depth) each, O(n^2) on a deep graph like a long linked list.
_Path = tuple[Any, str] | None

SCHEMA_VERSION = 1

# Never walked: immutable scalars hold no tensors, and code/classes/modules are shared by every
# object, so following them would audit the interpreter rather than the object asked about.
_LEAF_TYPES: tuple[type, ...] = (
    str, bytes, bytearray, int, float, complex, bool, type(None), range, memoryview, type,
    types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
    types.CodeType, types.FrameType, types.GeneratorType, types.CoroutineType,
    types.MappingProxyType, property, classmethod, staticmethod,
)
_SIMPLE_KEYS = (str, bytes, int, float, bool, type(None))


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditEntry:
    """One storage: the first path that reached it and every other path that aliases it."""

    path: str
    bytes: int
    device: str
    dtype: str
    shape: tuple[int, ...]
    aliases: tuple[str, ...] = ()
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "bytes": self.bytes, "device": self.device, "dtype": self.dtype,
                "shape": list(self.shape), "aliases": list(self.aliases), "note": self.note}


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditReport:
    """What `audit()` found; `truncated` means a cap stopped the walk and totals are a floor."""

    schema_version: int
    total_bytes: int
    entries: tuple[AuditEntry, ...]
    by_device: dict[str, int]
    num_tensors: int
    num_storages: int
    truncated: bool

    def bytes_under(self, prefix: str) -> int:
        """Bytes of entries whose first path starts with `prefix` (a plain string prefix)."""
        return sum(e.bytes for e in self.entries if e.path.startswith(prefix))

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": self.schema_version, "total_bytes": self.total_bytes,
                "by_device": dict(self.by_device), "num_tensors": self.num_tensors,
                "num_storages": self.num_storages, "truncated": self.truncated,
                "entries": [e.to_dict() for e in self.entries]}


def audit(obj: Any, *, max_objects: int = 1_000_000, max_depth: int = 64,
          root: str = "") -> AuditReport:
    """Walk `obj` breadth-first and report every torch storage it reaches, each counted once.

    `max_objects` caps distinct objects visited (tensors included) and `max_depth` caps how
    deep containers are expanded; hitting either sets `truncated`. `root` prefixes every path
    (e.g. root="cache" gives "cache.pools['c4_kv'].buffer").
    """
    for name, value, low in (("max_objects", max_objects, 1), ("max_depth", max_depth, 0)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(name, f"{value!r} is not a whole number", f"pass an integer of at least {low}")
    if max_objects < 1:
        raise ConfigError("max_objects", f"must be >= 1, got {max_objects}", "pass a positive cap")
    if max_depth < 0:
        raise ConfigError("max_depth", f"must be >= 0, got {max_depth}", "pass 0 or more")
    if not isinstance(root, str):
        raise ConfigError("root", f"{root!r} is not a string", "pass a path prefix such as 'cache', or ''")
    walker = _Walker(_import_torch(), max_objects, max_depth)
    walker.run(obj, root)
    return walker.report()


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ImportError("kvatlas.audit() needs torch to recognise tensors; install it with "
                          "`pip install 'kvatlas[torch]'`") from exc
    return torch


class _Walker:
    def __init__(self, torch: Any, max_objects: int, max_depth: int) -> None:
        self.tensor_type = torch.Tensor
        # torch value types that are not tensors and hold none: treat as leaves.
        self.leaves = _LEAF_TYPES + (torch.device, torch.dtype, torch.Size,
                                     torch.UntypedStorage, torch.TypedStorage)
        self.max_objects, self.max_depth = max_objects, max_depth
        self.seen: set[int] = set()  # ids of everything admitted: stops cycles and rewalks
        self.tensor_ids: set[int] = set()
        # storage key -> (entry of the first path, later paths); dicts keep BFS order.
        self.storages: dict[tuple, tuple[AuditEntry, list[str]]] = {}
        self.queue: deque[tuple[Any, _Path, int]] = deque()
        self.truncated = self.stopped = False

    def run(self, obj: Any, root: str) -> None:
        self._offer(obj, (None, root), 0)
        while self.queue and not self.stopped:
            node, path, depth = self.queue.popleft()
            for child, segment in _children(node, self.tensor_type):
                self._offer(child, (path, segment), depth + 1)
                if self.stopped:
                    return

    def _admit(self, obj: Any) -> bool:
        if len(self.seen) >= self.max_objects:
            self.truncated = self.stopped = True
            return False
        self.seen.add(id(obj))
        return True

    def _offer(self, obj: Any, path: _Path, depth: int) -> None:
        cls = type(obj)  # type(), not isinstance: a proxy's __class__ property must not run
        if issubclass(cls, self.tensor_type):
            # Tensors are leaves: record them wherever reached, depth cap or not.
            if id(obj) in self.tensor_ids or self._admit(obj):
                self.tensor_ids.add(id(obj))
                self._record(obj, path)
            return
        if issubclass(cls, self.leaves) or id(obj) in self.seen:
            return
        if depth > self.max_depth:
            self.truncated = True
            return
        if self._admit(obj):
            self.queue.append((obj, path, depth))

    def _record(self, t: Any, chain: _Path) -> None:
        key, nbytes, note = _storage_key(t)
        path = _render(chain)
        if key in self.storages:
            self.storages[key][1].append(path)
            return
        entry = AuditEntry(path=path, bytes=nbytes, device=str(t.device),
                           dtype=str(t.dtype).removeprefix("torch."),
                           shape=tuple(int(d) for d in t.shape), note=note)
        self.storages[key] = (entry, [])

    def report(self) -> AuditReport:
        entries = tuple(replace(e, aliases=tuple(a)) for e, a in self.storages.values())
        by_device: dict[str, int] = {}
        for e in entries:
            by_device[e.device] = by_device.get(e.device, 0) + e.bytes
        return AuditReport(schema_version=SCHEMA_VERSION, total_bytes=sum(by_device.values()),
                           entries=entries, by_device=by_device, num_tensors=len(self.tensor_ids),
                           num_storages=len(entries), truncated=self.truncated)


def _storage_key(t: Any) -> tuple[tuple, int, str]:
    """(key, bytes, note). Storages with no real address get a per-tensor key: they share
    data_ptr 0, and merging them would invent aliases that do not exist."""
    if t.device.type == "meta":
        return ("meta", id(t)), 0, "meta tensor: no memory behind it"
    try:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        return ("nostorage", id(t)), 0, f"no storage: {exc}"
    if ptr == 0:
        return ("empty", id(t)), 0, "empty storage"
    return (str(t.device), ptr), int(nbytes), ""


def _render(chain: _Path) -> str:
    segments = []
    while chain is not None:
        chain, segment = chain
        segments.append(segment)
    return "".join(reversed(segments))


def _children(obj: Any, tensor_type: type) -> Iterator[tuple[Any, str]]:
    """(child, path segment) pairs in a fixed order: items first, then slots, then __dict__."""
    cls = type(obj)
    if issubclass(cls, dict):
        for i, (k, v) in enumerate(list(obj.items())):
            if issubclass(type(k), tensor_type):
                yield k, f".keys()[{i}]"
            yield v, f"[{_key_label(k, i)}]"
    elif issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple):
        yield from ((v, f".{n}") for n, v in zip(cls._fields, obj))
    elif issubclass(cls, (list, tuple, deque)):
        yield from ((v, f"[{i}]") for i, v in enumerate(list(obj)))
    elif issubclass(cls, (set, frozenset)):
        yield from ((v, f"{{{i}}}") for i, v in enumerate(list(obj)))
    yield from _slot_values(obj)
    try:
        # object.__getattribute__ skips custom __getattribute__/__getattr__ (proxies, lazies).
        attrs = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return
    if isinstance(attrs, dict):
        yield from ((v, f".{k}") for k, v in list(attrs.items()))


def _slot_values(obj: Any) -> Iterator[tuple[Any, str]]:
    # Walk base classes first and read through each class's own member descriptor, so a
    # subclass property shadowing a slot name is never called.
    for cls in reversed(type(obj).__mro__):
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{cls.__name__.lstrip('_')}{name}"  # Python mangles private slots
            desc = cls.__dict__.get(name)
            if not isinstance(desc, types.MemberDescriptorType):
                continue
            try:
                value = desc.__get__(obj, cls)
            except AttributeError:  # slot never assigned
                continue
            yield value, f".{name}"


def _key_label(key: Any, index: int) -> str:
    """repr for plain keys; objects (tensors above all) get a short stand-in by position."""
    plain = isinstance(key, _SIMPLE_KEYS) or (
        isinstance(key, tuple) and all(isinstance(k, _SIMPLE_KEYS) for k in key))
    return repr(key) if plain else f"<{type(key).__name__} #{index}>"
