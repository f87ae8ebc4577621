"""Token ids for traces that carry prefix structure as block ids.

A trace such as Mooncake's says which prompts share content by giving each 512-token block of a
prompt an id: two requests whose id lists start alike share that prefix. To drive a
content-addressed cache with it, every block id must stand for fixed tokens. Here the tokens of
block b are a pure function of (seed, b, position in the block): token i is output i of
splitmix64 started from a 64-bit mix of (b, seed), reduced to the vocabulary. So

- the same id always yields the same tokens, in any request, process or machine (no state, no
  cache to warm: a 128K-token prompt is one vectorised pass of numpy over its tokens);
- the first n tokens of a block do not depend on how many are asked for (a request's last block
  is cut to its prompt length, and a shorter cut is a prefix of a longer one);
- different ids give different tokens except with negligible probability (each token is one of
  `VOCAB_SIZE`; two 512-token blocks agree by chance with probability ~ VOCAB_SIZE**-512), so the
  cache sees exactly the sharing the trace records, no more.

Synthetic workloads (sessions, shared system prompts) use the same scheme with pieces shorter
than a block: a piece is (block id, tokens), the first `tokens` tokens of that block. Their
content also covers each request's output (the tokens the next turn sends back), so a cache can
key the pages a request writes while it decodes.
"""

from __future__ import annotations

import numpy as np

BLOCK_TOKENS = 512          # Mooncake's hash block: one id per 512 prompt tokens
VOCAB_SIZE = 129_280        # DeepSeek-V3/V4 tokenizer vocabulary
MAX_BLOCK_ID = 2**63 - 1

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic): a bijection that spreads every bit."""
    x = x.copy()
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def block_tokens(block_ids, lengths=None, *, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> np.ndarray:
    """The token ids of consecutive pieces: piece i is the first lengths[i] tokens of block
    block_ids[i] (every piece a whole block when lengths is None). int32, C-contiguous."""
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0):
        raise ValueError(f"block ids must be ≥ 0, got {int(ids.min())}")
    n = np.full(ids.size, BLOCK_TOKENS, np.int64) if lengths is None else np.asarray(lengths, np.int64).reshape(-1)
    if n.size != ids.size:
        raise ValueError(f"{ids.size} block ids but {n.size} lengths")
    if n.size and (n.min() < 0 or n.max() > BLOCK_TOKENS):
        raise ValueError(f"a piece holds 0..{BLOCK_TOKENS} tokens of its block, got {int(n.min())}..{int(n.max())}")
    total = int(n.sum())
    with np.errstate(over="ignore"):
        # the block's state: its id mixed with the seed; then splitmix64's stream from that state
        base = _mix((ids.astype(np.uint64) + np.uint64(1)) * _GOLDEN ^ _mix(np.full(1, seed, np.uint64) + _GOLDEN))
        starts = np.cumsum(n) - n
        step = np.arange(1, total + 1, dtype=np.uint64) - np.repeat(starts, n).astype(np.uint64)
        mixed = _mix(np.repeat(base, n) + step * _GOLDEN)
    return (mixed % np.uint64(vocab_size)).astype(np.int32)


def covered_tokens(block_ids, lengths) -> int:
    return BLOCK_TOKENS * len(block_ids) if lengths is None else int(np.asarray(lengths, np.int64).sum())


class Prefix:
    """The first `n` entries of an array shared by many holders, as a read-only sequence that
    compares, hashes and slices like the tuple it stands for: a session's turn k holds all k
    previous turns' pieces, and a view instead of a copy keeps a session linear in its turns.
    `np.asarray` of it is a view too (no copy)."""

    __slots__ = ("_data", "_n")

    def __init__(self, data: np.ndarray, n: int) -> None:
        self._data, self._n = data, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self._data[: self._n][i].tolist())
        return int(self._data[: self._n][i])   # IndexError past the end, as a tuple's

    def __iter__(self):
        return iter(self._data[: self._n].tolist())

    def __array__(self, dtype=None, copy=None):
        view = self._data[: self._n]
        return view if dtype is None else view.astype(dtype, copy=False)

    def __eq__(self, other) -> bool:
        if isinstance(other, (tuple, Prefix)):
            return len(other) == self._n and tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        head = ", ".join(map(str, self._data[: min(self._n, 6)].tolist()))
        return f"Prefix({head}{', …' if self._n > 6 else ''}; {self._n} entries)"


def prompt_tokens_of(block_ids, lengths, prompt_tokens: int, start: int = 0, **kw) -> np.ndarray:
    """Tokens [start, prompt_tokens) of the pieces' concatenation (Mooncake's last block is
    partial: ceil(input_length / 512) ids cover input_length tokens)."""
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    if lengths is None:   # whole blocks: generate only the blocks the range reaches
        first = start // BLOCK_TOKENS
        ids = ids[first: -(-prompt_tokens // BLOCK_TOKENS)]
        start -= first * BLOCK_TOKENS
        prompt_tokens -= first * BLOCK_TOKENS
    toks = block_tokens(ids, lengths, **kw)
    if toks.size < prompt_tokens:
        raise ValueError(f"the blocks cover {toks.size} tokens, fewer than the {prompt_tokens} asked for")
    return toks[start:prompt_tokens]


def prefix_ceiling_blocks(requests) -> tuple[int, int]:
    """(blocks an unbounded prefix cache hits, all prompt blocks) over requests in arrival
    order: a block counts when it and every block before it in its request were seen in an
    earlier request. The ceiling any prefix cache can reach on a block-id trace (Mooncake's
    synthetic trace: 77,953 of 121,877, 63.96%). Requests without content are skipped."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        if r.blocks is None:
            continue
        n = -(-r.prompt_tokens // BLOCK_TOKENS) if r.block_lens is None else len(r.blocks)
        blocks = r.blocks[:n]
        for b in blocks:
            if b not in seen:
                break
            hit += 1
        total += len(blocks)
        seen.update(blocks)
    return hit, total
