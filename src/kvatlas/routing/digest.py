"""The router's own digest of a token prefix: fast on the request path, and matched to an engine's
blocks through the events' `token_ids` and parent links, never through the engine's hash.

K(q) = sum over i < q of (token_i + 1) * R_i, modulo 2**64, with R_i odd 64-bit weights drawn at
random per process (per position). One pass of numpy (a multiply and a cumulative sum) gives the
key of every block boundary of a 128K-token prompt at once, and a chain continues from any known
boundary: K(s + m) = K(s) + the sum over the m tokens after s. Two different prefixes of the same
length get one key with probability at most 2**-46 (token ids are below 2**18; the weights are
secret to the process, so a prompt cannot be crafted to collide); a collision can only mislead a
routing decision, never an engine. The index keys a block by (its block count << 64) | K there
(`block_keys`): one int naming the prefix and its length, from which a chain continues.
"""

from __future__ import annotations

import operator
import os
from array import array

import numpy as np

from ..errors import KvatlasError

MAX_TOKEN_ID = 2**32 - 1
U32_CODE = next(code for code in "IL" if array(code).itemsize == 4)   # a C unsigned 32-bit int


class TokenIdsError(KvatlasError):
    """token_ids passed for routing are not a list of token ids."""


class Digester:
    """One process's digest: every index and every prompt it scores must share one."""

    __slots__ = ("_weights", "_rng", "_offsets")

    def __init__(self, seed: int | None = None) -> None:
        self._rng = np.random.default_rng(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))
        self._weights = np.empty(0, dtype=np.uint64)
        self._offsets: list[int] = []

    def weights(self, stop: int) -> np.ndarray:
        if stop > len(self._weights):
            grow = max(stop, 2 * len(self._weights), 1 << 16) - len(self._weights)
            fresh = self._rng.integers(0, 2**63, size=grow, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
            self._weights = np.concatenate([self._weights, fresh])
        return self._weights

    def boundary_keys(self, token_ids, step: int, start: int = 0, key0: int = 0) -> list[int]:
        """K at start + step, start + 2*step, ... for `token_ids` laid from position `start`, whose
        prefix [0, start) has key `key0`. Only whole steps count."""
        tokens = as_tokens(token_ids)
        n = len(tokens) // step * step
        if n == 0:
            return []
        w = self.weights(start + n)[start:start + n]
        with np.errstate(over="ignore"):
            terms = (tokens[:n] + np.uint64(1)) * w
            sums = np.cumsum(terms.reshape(-1, step).sum(axis=1, dtype=np.uint64), dtype=np.uint64)
            if key0:
                sums += np.uint64(key0)
        return sums.tolist()

    def block_keys(self, token_ids, step: int, first: int = 0, key0: int = 0) -> list[int]:
        """The index's key of each whole block of `token_ids` laid after `first` blocks of `step`
        tokens whose digest is `key0`: (block count from token 0 << 64) | K there. One int a block,
        so a key names both the prefix and its length, and continues a chain (`>> 64`, `& mask`)."""
        sums = self.boundary_keys(token_ids, step, first * step, key0)
        stop = first + 1 + len(sums)
        if stop > len(self._offsets):
            self._offsets = [b << 64 for b in range(max(stop, 2 * len(self._offsets), 1024))]
        return list(map(operator.add, sums, self._offsets[first + 1:stop]))


def as_tokens(token_ids) -> np.ndarray:
    """token ids as an unsigned array (uint32 or uint64), refusing what is not one (a negative, a
    float, a nested list)."""
    if isinstance(token_ids, np.ndarray) and token_ids.dtype in (np.uint64, np.uint32):
        return token_ids
    if isinstance(token_ids, list):
        try:        # in C, a few ns an id: what a JSON body or a tokenizer hands over
            return np.frombuffer(array(U32_CODE, token_ids), dtype=np.uint32)
        except (TypeError, OverflowError):
            pass    # not ids in [0, 2**32): the checks below say which
    if hasattr(token_ids, "tokens_array"):
        return token_ids.tokens_array()
    try:
        arr = np.asarray(token_ids, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise TokenIdsError("token_ids: not a flat list of integers; pass the prompt's token ids") from None
    if arr.ndim != 1:
        raise TokenIdsError(f"token_ids: a {arr.ndim}-dimensional array; pass one flat list of token ids")
    if len(arr) and (int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID):
        raise TokenIdsError(f"token_ids: values must lie in [0, {MAX_TOKEN_ID}]; pass the tokenizer's ids")
    if arr.dtype != np.int64:
        raise TokenIdsError("token_ids: not integers; pass the tokenizer's ids")
    return arr.view(np.uint64)          # checked non-negative: the same bits, no copy
