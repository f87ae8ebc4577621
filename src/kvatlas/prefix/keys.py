"""Content keys: one 64-bit key per full page, chained, so a page's key covers every token before
it and equal keys mean equal prefixes (up to a 2^-64 collision)."""

from __future__ import annotations

import hashlib

import numpy as np

from ..errors import KvatlasError


def _as_tokens(token_ids) -> np.ndarray:
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise KvatlasError("token_ids: give a flat sequence of integer token ids")
    return ids.astype(np.int64, copy=False)


def page_keys(token_ids, page_tokens: int, parent: int = 0) -> np.ndarray:
    """Keys of the full pages of `token_ids` (a partial last page has none): key i hashes key
    i - 1 (`parent` for the first) and page i's token ids."""
    ids = _as_tokens(token_ids)
    n = len(ids) // page_tokens
    out = np.empty(n, np.uint64)
    raw = ids[: n * page_tokens].tobytes()
    step = page_tokens * 8
    prev = int(parent).to_bytes(8, "little")
    for i in range(n):
        prev = hashlib.blake2b(prev + raw[i * step:(i + 1) * step], digest_size=8).digest()
        out[i] = int.from_bytes(prev, "little")
    return out


def check_keys(keys, prompt_tokens: int, page_tokens: int) -> np.ndarray:
    """Precomputed keys (trace replay): at most one per full page of the prompt."""
    arr = np.asarray(keys)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise KvatlasError("page_keys: give a flat sequence of integer keys, one per full page")
    if len(arr) > prompt_tokens // page_tokens:
        raise KvatlasError(f"page_keys: {len(arr)} keys for {prompt_tokens // page_tokens} full pages of the "
                           "prompt; give one key per full page (a partial last page has none)")
    return arr.astype(np.uint64)
