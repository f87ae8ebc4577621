"""Request traces in JSONL, read as a stream: kvatlas's own format and Mooncake's.

kvatlas format, one object per line:
    {"arrival_s": 0.12, "prompt_tokens": 900, "output_tokens": 128}
  optional: "id" (unique), "blocks" (block ids of the prompt's content, `driving.content`),
  "block_lens" (tokens of each block used, 0..512; default whole blocks), "after" (the id of a
  request on an earlier line that this one follows, e.g. the previous turn of a session) and
  "think_s" (seconds after that request finishes).
Mooncake format (the FAST '25 release's traces), one object per line:
    {"timestamp": 40, "input_length": 23769, "output_length": 3, "hash_ids": [151, 152, ...]}
  timestamp in milliseconds; one hash id per 512-token block, ceil(input_length / 512) of them.
  Its requests are named by line: "line7".

`fmt="auto"` decides per line: a line with any of kvatlas's fields (arrival_s / prompt_tokens /
output_tokens) is kvatlas's, whatever else it carries (a stray "timestamp" too); otherwise a line
with any of timestamp / input_length / hash_ids is Mooncake.
Blank lines and lines starting with '#' are ignored. A file whose first line is not UTF-8 is
refused as a whole (ConfigError): it is not a text trace. Otherwise a bad line — not UTF-8, longer than
`max_line_bytes`, not JSON, a field missing or out of range, an id seen on an earlier line — is
reported with its line number and skipped (or, with strict=True, fatal), so a long trace is never
abandoned midway. The file is read line by line with a bounded read: a file without newlines costs
`max_line_bytes` of memory, not its size.

A trace is a regular file or a pipe: a device (/dev/zero) or a socket is refused before a byte is
read. A file larger than MAX_TRACE_BYTES is refused up front; a pipe is read until that many
bytes or MAX_TRACE_LINES lines, then refused (a stream that never ends cannot be a trace).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import stat
from collections.abc import Iterator

from ..errors import ConfigError
from .content import BLOCK_TOKENS
from .workload import Request

FORMATS = ("auto", "kvatlas", "mooncake")
MAX_LINE_BYTES = 1 << 20     # Mooncake's longest line is 2.7 KB (374 block ids); 1 MiB is generous
MAX_PROBLEMS = 1000
MAX_TRACE_BYTES = 1 << 30    # Mooncake's whole synthetic trace is 10 MB (3,993 lines)
MAX_TRACE_LINES = 2_000_000   # ~1 GB of requests in memory: 500 times the Mooncake trace
_MOONCAKE_KEYS = ("timestamp", "input_length", "hash_ids")
_KVATLAS_KEYS = ("arrival_s", "prompt_tokens", "output_tokens")
_FIX = {
    "kvatlas": 'write one object per line: {"arrival_s": 0.5, "prompt_tokens": 900, "output_tokens": 128}',
    "mooncake": 'write one object per line: {"timestamp": MS, "input_length": N, "output_length": N, '
                '"hash_ids": [one id per 512 tokens]}',
}


class TraceError(ConfigError):
    """A line of a JSONL trace is malformed."""

    def __init__(self, path: str, line_no: int, problem: str, fmt: str = "kvatlas") -> None:
        self.line_no = line_no
        super().__init__(f"{path}:{line_no}", problem, _FIX.get(fmt, _FIX["kvatlas"]))


def _positive_int(obj: dict, key: str) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{key!r} must be an integer ≥ 1, got {_short(v)}")
    return v


def _time(obj: dict, key: str, unit: str) -> float:
    t = obj.get(key)
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
        raise ValueError(f"{key!r} must be a number ≥ 0 ({unit}), got {_short(t)}")
    return float(t)


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _int_list(obj: dict, key: str, lo: int, hi: int) -> tuple[int, ...]:
    v = obj.get(key)
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi for x in v):
        raise ValueError(f"{key!r} must be a list of integers in [{lo}, {hi}], got {_short(v)}")
    return tuple(v)


def _content(obj: dict, prompt_tokens: int) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    if "blocks" not in obj:
        if "block_lens" in obj:
            raise ValueError("'block_lens' needs 'blocks'")
        return None, None
    blocks = _int_list(obj, "blocks", 0, 2**63 - 1)
    lens = _int_list(obj, "block_lens", 0, BLOCK_TOKENS) if "block_lens" in obj else None
    if lens is not None and len(lens) != len(blocks):
        raise ValueError(f"'block_lens' has {len(lens)} entries for {len(blocks)} blocks")
    covered = sum(lens) if lens is not None else BLOCK_TOKENS * len(blocks)
    if covered < prompt_tokens:
        raise ValueError(f"'blocks' cover {covered} tokens, fewer than 'prompt_tokens' {prompt_tokens}")
    return blocks, lens


def parse_kvatlas(obj: dict, line_no: int) -> Request:
    t = _time(obj, "arrival_s", "seconds")
    prompt, output = _positive_int(obj, "prompt_tokens"), _positive_int(obj, "output_tokens")
    blocks, lens = _content(obj, prompt)
    rid = obj.get("id", f"line{line_no}")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise ValueError(f"'id' must be a string or an integer, got {_short(rid)}")
    after = obj.get("after")
    if after is not None and (not isinstance(after, (str, int)) or isinstance(after, bool)):
        raise ValueError(f"'after' must be the id of an earlier request, got {_short(after)}")
    think = _time(obj, "think_s", "seconds") if "think_s" in obj else 0.0
    return Request(id=str(rid), arrival_s=t, prompt_tokens=prompt, output_tokens=output, blocks=blocks,
                   block_lens=lens, after=None if after is None else str(after), think_s=think)


def parse_mooncake(obj: dict, line_no: int) -> Request:
    t = _time(obj, "timestamp", "milliseconds")
    prompt, output = _positive_int(obj, "input_length"), _positive_int(obj, "output_length")
    blocks = _int_list(obj, "hash_ids", 0, 2**63 - 1)
    need = -(-prompt // BLOCK_TOKENS)
    if len(blocks) != need:
        raise ValueError(f"'hash_ids' has {len(blocks)} ids; 'input_length' {prompt} needs ceil({prompt} / "
                         f"{BLOCK_TOKENS}) = {need}")
    return Request(id=f"line{line_no}", arrival_s=t / 1e3, prompt_tokens=prompt, output_tokens=output, blocks=blocks)


def line_format(obj: dict, fmt: str = "auto") -> str:
    if fmt != "auto":
        return fmt
    if any(k in obj for k in _KVATLAS_KEYS):
        return "kvatlas"
    return "mooncake" if any(k in obj for k in _MOONCAKE_KEYS) else "kvatlas"


def parse_trace_line(line: str, line_no: int, fmt: str = "auto") -> Request:
    """One trace line as a Request; ValueError says what is wrong with it."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise ValueError("not JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    kind = line_format(obj, fmt)
    try:
        return parse_mooncake(obj, line_no) if kind == "mooncake" else parse_kvatlas(obj, line_no)
    except ValueError as exc:
        raise _FieldError(str(exc), kind) from None


class _FieldError(ValueError):
    """A field of a line in a known format is wrong: the fix shows that format."""

    def __init__(self, problem: str, fmt: str) -> None:
        super().__init__(problem)
        self.fmt = fmt


def _raw_lines(fh, max_line_bytes: int, path: str = "") -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, bytes, length) per line; bytes None when the line exceeds the bound (its
    rest is read in bounded pieces and dropped, so memory stays at max_line_bytes). Stops with a
    ConfigError past MAX_TRACE_BYTES or MAX_TRACE_LINES (a pipe that never ends)."""
    line_no = total = 0
    while True:
        data = fh.readline(max_line_bytes + 1)
        if not data:
            return
        line_no += 1
        total += len(data)
        if total > MAX_TRACE_BYTES or line_no > MAX_TRACE_LINES:
            raise ConfigError("workload", f"{path!r} goes on past {MAX_TRACE_BYTES:,} bytes or {MAX_TRACE_LINES:,} "
                              f"lines (line {line_no:,})", "give a finite trace within those bounds (split a larger one)")
        if len(data) <= max_line_bytes or data.endswith(b"\n"):
            yield line_no, data, len(data)
            continue
        size = len(data)
        while data and not data.endswith(b"\n"):
            data = fh.readline(1 << 16)
            size += len(data)
            total += len(data)
            if total > MAX_TRACE_BYTES:
                raise ConfigError("workload", f"{path!r} goes on past {MAX_TRACE_BYTES:,} bytes (line {line_no:,} "
                                  "never ends)", "give a finite trace of one request per line")
        yield line_no, None, size


class _NotText(ValueError):
    pass


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _NotText(f"not UTF-8 (byte 0x{data[exc.start]:02x} at column {exc.start + 1})") from None


def iter_trace(path: str, *, fmt: str = "auto", strict: bool = False, on_error=None,
               max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[Request]:
    """The requests of a trace in file order, as they are read. A bad line is reported through
    `on_error(line_no, problem)` and skipped; with strict=True it raises TraceError."""
    if fmt not in FORMATS:
        raise ConfigError("trace_format", f"{fmt!r} is not a trace format", f"use one of {', '.join(FORMATS)}")
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError("workload", f"{path!r} is not a path", "give the trace file's path")
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise ConfigError("workload", f"cannot read {path!r} ({exc.strerror})", "give an existing JSONL file") from None
    seen: dict[str, int] = {}
    with fh:
        _check_kind(fh, path)
        for line_no, data, size in _raw_lines(fh, max_line_bytes, path):
            try:
                req = _parse(data, size, line_no, fmt, max_line_bytes, seen)
            except ValueError as exc:
                if isinstance(exc, _NotText) and not seen:   # a binary or wrongly encoded file
                    raise ConfigError("workload", f"{path!r} is not UTF-8 text (line {line_no}: {exc})",
                                      "give a JSONL trace saved as UTF-8") from None
                if strict:
                    shown = exc.fmt if isinstance(exc, _FieldError) else "kvatlas" if fmt == "auto" else fmt
                    raise TraceError(path, line_no, str(exc), shown) from None
                if on_error is not None:
                    on_error(line_no, str(exc))
                continue
            if req is not None:
                seen[req.id] = line_no
                yield req


def _check_kind(fh, path: str) -> None:
    """A regular file within the size bound, or a pipe; anything else is refused unread."""
    st = os.fstat(fh.fileno())
    if stat.S_ISREG(st.st_mode):
        if st.st_size > MAX_TRACE_BYTES:
            raise ConfigError("workload", f"{path!r} is {st.st_size:,} bytes, more than the {MAX_TRACE_BYTES:,}-byte "
                              "bound", "split the trace, or simulate a part of it")
        return
    if not stat.S_ISFIFO(st.st_mode):
        kind = "a character device" if stat.S_ISCHR(st.st_mode) else "a block device" if stat.S_ISBLK(st.st_mode) \
            else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a file"
        raise ConfigError("workload", f"{path!r} is {kind}, not a regular file or a pipe",
                          "give a JSONL trace file (or a pipe that ends)")


def _parse(data, size: int, line_no: int, fmt: str, max_line_bytes: int, seen: dict) -> Request | None:
    if data is None:
        raise ValueError(f"line of {size:,} bytes is longer than the {max_line_bytes:,}-byte bound; "
                         "write one request per line")
    text = _decode(data).strip()
    if line_no == 1:
        text = text.removeprefix("\ufeff")   # a byte-order mark some editors write
    if not text or text.startswith("#"):
        return None
    req = parse_trace_line(text, line_no, fmt)
    if req.id in seen:
        raise ValueError(f"id {req.id!r} repeats line {seen[req.id]}; give each request its own id")
    if req.after is not None and req.after not in seen:
        raise ValueError(f"'after' {req.after!r} names no request on an earlier line")
    return req


def read_trace(path: str, *, fmt: str = "auto", strict: bool = False, on_error=None,
               max_line_bytes: int = MAX_LINE_BYTES) -> tuple[list[Request], list[tuple[int, str]]]:
    """(requests sorted by arrival, [(line number, problem)] of the first MAX_PROBLEMS skipped
    lines); `on_error` hears of every one."""
    problems: list[tuple[int, str]] = []

    def note(line_no: int, problem: str) -> None:
        if len(problems) < MAX_PROBLEMS:   # a file of garbage must not grow a list without bound
            problems.append((line_no, problem))
        if on_error is not None:
            on_error(line_no, problem)

    requests = list(iter_trace(path, fmt=fmt, strict=strict, on_error=note, max_line_bytes=max_line_bytes))
    requests.sort(key=lambda r: r.arrival_s)
    return requests, problems


def write_trace(path: str, requests) -> None:
    """kvatlas format; content and session links are written when the requests carry them."""
    with open(path, "w", encoding="utf-8") as fh:
        for r in requests:
            obj = {"id": r.id, "arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
                   "output_tokens": r.output_tokens}
            if r.blocks is not None:
                obj["blocks"] = list(r.blocks)
            if r.block_lens is not None:
                obj["block_lens"] = list(r.block_lens)
            if r.after is not None:
                obj["after"], obj["think_s"] = r.after, r.think_s
            fh.write(json.dumps(obj) + "\n")


_ID_MASK = (1 << 63) - 1              # block ids are 0 .. 2**63 - 1
_PIECE = 0x9E3779B97F4A7C15           # a piece of a page longer than a block: its key mixed with its index
_TAIL = 0x5851F42D4C957F2D            # prompts' partial last pages: ids no key maps to (but by chance)


def _cut(blocks: list, lens: list, tokens: int, ids) -> None:
    """`tokens` as blocks of at most BLOCK_TOKENS appended to blocks/lens, their ids from `ids`."""
    for at, block in zip(range(0, tokens, BLOCK_TOKENS), ids):
        blocks.append(block & _ID_MASK)
        lens.append(min(BLOCK_TOKENS, tokens - at))


def served_requests(rows) -> list[Request]:
    """Requests for what a prefix cache served (`PrefixCache.served()`: kvatlas.prefix.record.Served
    rows), in kvatlas's format, content included: each full page's key becomes the id of its tokens
    (pages longer than a block, several ids), so two requests share exactly the pages whose keys
    they shared (keys are chained: a key names its page's whole prefix), pages written after the
    prompt included where they were keyed, and each request's partial last page gets tokens of
    its own. Requests admitted without keys get none (length only).
    Output tokens are at least 1 (a request cut at its prompt is replayed writing one). In order
    of arrival, requests that arrived together in the order they arrived in (were enqueued, or
    admitted if never queued)."""
    out = []
    for n, r in enumerate(sorted(rows, key=lambda r: (r.arrival_s, r.order))):
        blocks = lens = None
        keys = [int(k) for k in r.page_keys]
        if keys:
            blocks, lens = [], []
            for k in keys:
                _cut(blocks, lens, r.page_tokens, (k ^ (j * _PIECE) for j in itertools.count()))
            # the rest of the prompt, and when pages past it were keyed (its output was known), the
            # rest of the output: the replay then keys the same pages
            end = r.prompt_tokens + (max(r.output_tokens, 1) if len(keys) * r.page_tokens > r.prompt_tokens else 0)
            _cut(blocks, lens, end - len(keys) * r.page_tokens, itertools.count(_TAIL + (n << 16)))
        out.append(Request(id=f"served{n}", arrival_s=float(r.arrival_s), prompt_tokens=int(r.prompt_tokens),
                           output_tokens=max(int(r.output_tokens), 1), blocks=None if blocks is None else tuple(blocks),
                           block_lens=None if lens is None else tuple(lens)))
    return out
